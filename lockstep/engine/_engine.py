"""The engine: plain arrays on a `jax.sharding.Mesh` with named axes. It holds the mesh, batch
placement, the `run` compiler and reading per-replica arrays back; data parallelism is the mesh
with one axis, ``"batch"`` (`BATCH_AXIS`), over which rows are split and reductions run. It knows
no strategy: the `tf.distribute` face (`lockstep.distribute`) is built on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ._compiler import RunCompiler
from ._cross_replica import BATCH_AXIS, ReplicatedCall, gather_stacked
from ._layout import StepInfo
from ._placement import BatchDistributor
from ._replica_context import ReplicaContext


class Engine:
    """Compiled replica functions on plain global arrays over a mesh of `devices`.

    `run_arrays` runs a replica function whose arguments and results are plain global arrays
    of declared kinds; lockstep's `Trainer` drives its compiled steps through it. `owner` (the
    strategy built on it) is what replica contexts name as their ``strategy`` and what error
    messages about values of another engine name.

    >>> import jax, numpy as np
    >>> from lockstep.engine import Engine, get_replica_context
    >>> engine = Engine(jax.devices()[:2])
    >>> engine.mesh.axis_names
    ('batch',)
    >>> total, = engine.run_arrays(lambda v: (get_replica_context().all_reduce("SUM", v),),
    ...                            (np.array([[1.0], [2.0]]),), kinds=("per_replica",), out_kinds=("replicated",))
    >>> total.tolist()
    [3.0]
    """

    def __init__(self, devices: Sequence[jax.Device], owner: Any = None):
        self.mesh = Mesh(np.asarray(devices, dtype=object), (BATCH_AXIS,), axis_types=(AxisType.Auto,))
        self.owner = owner
        self.num_replicas = len(devices)
        self.distributor = BatchDistributor(self.mesh, self)
        self.replicated_call = ReplicatedCall(self.mesh)
        self._compiler = RunCompiler(
            self.mesh, lambda mask, count, typed: ReplicaContext(self.num_replicas, mask, count, typed, owner))

    @property
    def num_local_replicas(self) -> int:
        """How many of the replicas this worker's devices hold."""
        return len(self.distributor.local_replica_ids)

    def local_entries(self, stacked: jax.Array) -> tuple[jax.Array, ...]:
        """This worker's replicas' entries of a per-replica (R, ...) array, in replica order."""
        shards = sorted(stacked.addressable_shards, key=lambda s: s.index[0].start or 0)
        return tuple(s.data[0] for s in shards)

    def agree_on_programs(self, check: Callable[[str], None] | None) -> None:
        """Calls `check(description)` before each new compiled program runs (the workers of a
        multi-worker strategy check that they all run the same one)."""
        self._compiler.agree_with(check)

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


def _first_local(stacked: jax.Array) -> jax.Array:
    """Entry 0 of this worker's first replica of a per-replica array."""
    shard = min(stacked.addressable_shards, key=lambda s: s.index[0].start or 0)
    return shard.data[0]
