"""The engine: plain arrays on a `jax.sharding.Mesh` with named axes. It holds the mesh, batch
placement, the `run` compiler and reading per-replica arrays back. Rows are split and reductions
run over one named axis, the batch axis (``"batch"`` by default, `BATCH_AXIS`), or a tuple of
axes whose devices together hold the replicas (hybrid sharding: replicas across nodes and within
them); data parallelism is the mesh with that axis alone; a mesh with more axes holds a copy of
each replica's work along the others, which is where model parallelism lays its shards. It knows no strategy: the
`tf.distribute` face (`lockstep.distribute`) is built on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ._compiler import RunCompiler
from ._cross_replica import ReplicatedCall, axis_names, gather_stacked, spread
from ._batch_rows import StepInfo
from ._placement import BatchDistributor
from ._replica_context import ReplicaContext

#: The default name of the mesh axis over which rows are split and replicas reduce.
BATCH_AXIS = "batch"


class Engine:
    """Compiled replica functions on plain global arrays over a mesh: a 1-D mesh of `devices`,
    or `mesh` (a `jax.sharding.Mesh` with named axes), whose axis `batch_axis` holds the replicas.

    `run_arrays` runs a replica function whose arguments and results are plain global arrays
    of declared kinds; lockstep's `Trainer` drives its compiled steps through it. `owner` (the
    strategy built on it) is what replica contexts name as their ``strategy`` and what error
    messages about values of another engine name. On a mesh with other axes besides `batch_axis`,
    each replica's work is done alike on the devices along them (a copy each).

    >>> import jax, numpy as np
    >>> from lockstep.engine import Engine, get_replica_context
    >>> engine = Engine(jax.devices()[:2])
    >>> engine.mesh.axis_names
    ('batch',)
    >>> total, = engine.run_arrays(lambda v: (get_replica_context().all_reduce("SUM", v),),
    ...                            (np.array([[1.0], [2.0]]),), kinds=("per_replica",), out_kinds=("replicated",))
    >>> total.tolist()
    [3.0]
    >>> from jax.sharding import Mesh
    >>> wide = Engine(mesh=Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("batch", "model")))
    >>> wide.num_replicas, wide.batch_axis
    (2, 'batch')
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None, owner: Any = None, *, mesh: Mesh | None = None,
                 batch_axis: str | tuple[str, ...] = BATCH_AXIS, split_model_axes: bool = False):
        if (devices is None) == (mesh is None):
            raise ValueError("give an `Engine` one of `devices` (a 1-D mesh) and `mesh`, got "
                             f"{'both' if mesh is not None else 'neither'}.")
        if not isinstance(batch_axis, str):  # replicas along several axes (hybrid sharding), the first major
            batch_axis = tuple(batch_axis) if len(batch_axis) != 1 else batch_axis[0]
            if mesh is None and not isinstance(batch_axis, str):
                raise ValueError(f"a 1-D mesh of `devices` has one axis: give `batch_axis` one name, got {batch_axis!r} "
                                 "(a tuple of axes needs `mesh`).")
        if mesh is None:
            mesh = Mesh(np.asarray(devices, dtype=object), axis_names(batch_axis), axis_types=(AxisType.Auto,))
        if not batch_axis or any(a not in mesh.axis_names for a in axis_names(batch_axis)):
            raise ValueError(f"`batch_axis` {batch_axis!r} is not an axis of `mesh` (or a tuple of its axes), whose axes "
                             f"are {mesh.axis_names}.")
        self.mesh = mesh
        self.batch_axis = batch_axis
        self.owner = owner
        self.distributor = BatchDistributor(mesh, batch_axis, self)
        self.num_replicas = self.distributor.num_replicas
        self.replicated_call = ReplicatedCall(mesh)
        self._compiler = RunCompiler(mesh, batch_axis, lambda mask, count, typed: ReplicaContext(
            self.num_replicas, mask, count, typed, owner, axis_name=batch_axis),
            manual_axes=_manual_axes(mesh, batch_axis, split_model_axes))

    @property
    def num_local_replicas(self) -> int:
        """How many of the replicas this worker's devices hold."""
        return len(self.distributor.local_replica_ids)

    def local_entries(self, stacked: jax.Array) -> tuple[jax.Array, ...]:
        """This worker's replicas' entries of a per-replica (R, ...) array, in replica order (one
        copy of each where the mesh has other axes)."""
        return tuple(s.data[0] for s in _one_copy_each(stacked))

    def agree_on_programs(self, agreement: Any) -> None:
        """Calls `agreement.check(description)` before each new compiled program runs (the workers
        of a multi-worker strategy check that they all run the same one), and
        `agreement.check_values(what, values)` at the end of each pass over global batches (their
        checksums: every worker read the same batches)."""
        self._compiler.agree_with(agreement.check)
        self.distributor.agree_on_values = agreement.check_values

    def put_replicated(self, x: Any) -> Any:
        """`x` (a pytree of arrays) copied to every device (NumPy leaves stay exact)."""
        return self.distributor.put_replicated(x)

    def run_arrays(self, fn: Callable[..., Any], args: tuple[Any, ...], kinds: Any, out_kinds: Any,
                   mask: jax.Array | None = None, count: jax.Array | None = None, check_vma: bool = True) -> Any:
        """`fn(*args)` on every replica; see `RunCompiler.call_declared` for the kinds and
        `check_vma`.

        `mask` and `count` (a distributed batch's) make the replica context that layers and
        user code read with `get_replica_context()`.
        """
        return self._compiler.call_declared(fn, args, kinds, out_kinds, mask=mask, count=count, check_vma=check_vma)

    def mapped(self, fn: Callable[..., Any], kinds: Any, out_kinds: Any, check_vma: bool = True,
               with_batch: bool = True) -> Callable[..., Any]:
        """`fn` on every replica as an uncompiled `shard_map` of ``(*args, mask, count)``, for a
        caller's own `jax.jit` around it; see `RunCompiler.mapped`."""
        return self._compiler.mapped(fn, kinds, out_kinds, check_vma=check_vma, with_batch=with_batch)

    def jit(self, fn: Callable[..., Any], out_shardings: Any, donate_argnums: tuple[int, ...] = ()
            ) -> Callable[..., Any]:
        """`jax.jit(fn, out_shardings=..., donate_argnums=...)` on global arrays, which the workers
        of a job agree on and whose calls count among the steps in flight; see `RunCompiler.jit`."""
        return self._compiler.jit(fn, out_shardings, donate_argnums)

    def place(self, tree: Any, shardings: Any) -> Any:
        """Host arrays (a tree) laid out as `shardings` (a tree alike of `NamedSharding`s): each
        device receives only its slice."""
        def one(x: Any, sharding: Any) -> jax.Array:
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            if spread(x):  # a global array other workers hold shards of: laid out anew on the devices
                return jax.device_put(x, sharding)
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
        return jax.tree.map(one, tree, shardings)

    def run_inferred(self, fn: Callable[..., Any], args: tuple[Any, ...], kinds: Any, mask: Any, count: Any,
                     with_kwargs: bool = False) -> tuple[Any, tuple[bool, ...]]:
        """Like `run_arrays`, the outputs' kinds read off the trace: (outputs, replicated flags)."""
        return self._compiler.call_inferred(fn, args, kinds, mask=mask, count=count, with_kwargs=with_kwargs)

    @property
    def steps_in_flight(self) -> int:
        """Compiled steps dispatched and not yet waited for (bounded: DESIGN.md's CPU deadlock)."""
        return self._compiler.steps_in_flight

    def compile_counts(self, fn: Callable[..., Any] | None = None) -> list[int]:
        """For each cached program of `fn` (one per argument signature; every function's if None),
        how often it compiled."""
        return self._compiler.compile_counts(fn)

    def run_to_host(self, fn: Callable[..., Any], args: tuple[Any, ...], kinds: Any) -> Any:
        """`fn(*args)` on every replica, for outputs meant to be identical on every replica (say,
        metric values after an all-reduce or all-gather): each comes back as one array readable
        on this worker."""
        out, flags = self.run_inferred(fn, args, kinds, None, None)
        leaves, tree = jax.tree.flatten(out)
        return jax.tree.unflatten(tree, [o if same else _first_local(o) for o, same in zip(leaves, flags)])

    def per_replica_copies(self, tree: Any) -> Any:
        """`tree` (arrays) given to every replica: each leaf becomes a per-replica (R, ...) array."""
        r = len(self.distributor.local_replica_ids)
        stacked = [np.broadcast_to(np.asarray(x), (r, *np.shape(x))) for x in jax.tree.leaves(tree)]
        placed = self.distributor.place_split(stacked, self.distributor.num_replicas)
        return jax.tree.unflatten(jax.tree.structure(tree), placed)

    def place_per_replica(self, tree: Any) -> Any:
        """Per-replica (R, ...) arrays placed one entry per replica (NumPy or global arrays)."""
        ids = self.distributor.local_replica_ids

        def one(x: Any) -> Any:
            if isinstance(x, jax.Array) and x.sharding == self.distributor.split:
                return x
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return jax.device_put(x, self.distributor.split)
            return self.distributor.place_split([np.asarray(x)[ids[0]:ids[-1] + 1]], self.distributor.num_replicas)[0]
        return jax.tree.map(one, tree)

    def real_rows(self, tree: Any, step: StepInfo) -> Any:
        """Per-replica batch outputs (R, b, ...) as the batch's real rows in order, readable here."""
        return jax.tree.map(lambda v: gather_stacked(self.replicated_call, v, step, 0), tree)


def _manual_axes(mesh: Mesh, batch_axis: str | tuple[str, ...], split_model_axes: bool) -> frozenset[str]:
    """The axes replica functions see one device of (`shard_map`'s axis_names; empty: all). With
    `split_model_axes` (a sharded model's) steps leave the model axes to the compiler, which lays
    their shards out (tensor parallelism), unless the batch axis has one device: XLA's SPMD partitioner then
    refuses a collective over it ("Cross-partition allreduce must be in (partial) manual
    partitioning mode"), so the step sees whole parameters (gathered along the model axes)."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if not split_model_axes or math.prod(sizes[a] for a in axis_names(batch_axis)) == 1:
        return frozenset()
    return frozenset(axis_names(batch_axis))


def _one_copy_each(stacked: jax.Array) -> list[Any]:
    """This worker's shards of a per-replica array, one per replica, in replica order."""
    by_start = {}
    for s in stacked.addressable_shards:
        by_start.setdefault(s.index[0].start or 0, s)
    return [by_start[k] for k in sorted(by_start)]


def _first_local(stacked: jax.Array) -> jax.Array:
    """Entry 0 of this worker's first replica of a per-replica array."""
    return _one_copy_each(stacked)[0].data[0]
