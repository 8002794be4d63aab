"""Strategies: `OneDeviceStrategy`, `MirroredStrategy`, and the scope machinery."""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._reduce import ReduceOp
from ._values import (
    AXIS,
    DistributedBatch,
    Mirrored,
    PerReplica,
    ReplicaContext,
    StepInfo,
    _highest,
    _lowest,
    _varies,
    is_distributed,
    replica_context,
)

#: Most compiled steps lockstep lets run ahead of the host before it waits on the oldest
#: (DESIGN.md: more than ~32 collective steps in flight wedge XLA on a multi-device CPU).
MAX_STEPS_IN_FLIGHT = int(os.environ.get("LOCKSTEP_MAX_STEPS_IN_FLIGHT", "8"))

# traced arguments; Python scalars (flags such as `training=True`) are static, as in tf.distribute
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


class InputContext:
    """What a per-worker input function needs to know, as in `tf.distribute.InputContext`.

    >>> import lockstep as ls
    >>> ctx = ls.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    >>> ctx.get_per_replica_batch_size(64)
    8
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync`.

        Raises:
          ValueError: `global_batch_size` does not divide by the number of replicas.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"`global_batch_size` must be a multiple of num_replicas_in_sync="
                f"{self.num_replicas_in_sync}, got global_batch_size={global_batch_size}."
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self.input_pipeline_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class ValueContext:
    """What `experimental_distribute_values_from_function`'s function knows: which replica it builds for."""

    def __init__(self, replica_id_in_sync_group: int, num_replicas_in_sync: int):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync


class _RunEntry:
    """A compiled `run` for one function, argument structure and argument shapes."""

    __slots__ = ("call", "flags", "out_tree")

    def __init__(self) -> None:
        self.call: Callable[..., Any] | None = None
        self.flags: tuple[bool, ...] | None = None
        self.out_tree: Any = None


class Strategy:
    """Synchronous data parallelism over a 1-D mesh of devices (axis name ``"replica"``).

    Use a subclass: `OneDeviceStrategy`, `MirroredStrategy` or `MultiWorkerMirroredStrategy`.
    """

    def __init__(self, devices: Sequence[jax.Device]):
        self._devices = tuple(devices)
        self._mesh = Mesh(np.asarray(self._devices, dtype=object), (AXIS,), axis_types=(AxisType.Auto,))
        self._replicated = NamedSharding(self._mesh, P())
        self._split = NamedSharding(self._mesh, P(AXIS))
        self._runs: dict[Any, _RunEntry] = {}
        self._helpers: dict[Any, Callable[..., Any]] = {}
        self._counts: dict[int, jax.Array] = {}
        self._masks: dict[Any, tuple[jax.Array, StepInfo]] = {}
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._lock = threading.Lock()

    # --- facts -------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas taking part in each step, over all workers."""
        return len(self._devices)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    @property
    def mesh(self) -> Mesh:
        """The 1-D `jax.sharding.Mesh` (axis ``"replica"``) that steps run on."""
        return self._mesh

    @property
    def _local_devices(self) -> tuple[jax.Device, ...]:
        return tuple(d for d in self._devices if d.process_index == jax.process_index())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"

    # --- scope -------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this strategy the one `get_strategy()` returns inside the block.

        A Keras 3 model built inside the block gets its variables replicated on this strategy's
        devices (Keras' own `DataParallel` distribution is in force there), and a `Trainer` made
        later for that model, outside any scope, runs on this strategy — as in `tf.distribute`.

        >>> import lockstep as ls
        >>> s = ls.MirroredStrategy(2)
        >>> with s.scope():
        ...     ls.get_strategy() is s
        True
        """
        _SCOPES.stack.append(self)
        _RECENT.append(weakref.ref(self))
        del _RECENT[:-16]
        previous = _enter_keras_distribution(self)
        try:
            yield self
        finally:
            _SCOPES.stack.pop()
            _exit_keras_distribution(previous)

    # --- checks ------------------------------------------------------------------------
    def _check_owner(self, value: Any, arg: str) -> None:
        if value._strategy is not self:
            raise ValueError(
                f"`{arg}` holds a {type(value).__name__} value made by {value._strategy!r}, "
                f"but this call is on another strategy, {self!r}. Distributed values are bound "
                "to the strategy whose `run` or dataset made them."
            )

    # --- placement ---------------------------------------------------------------------
    def _put_replicated(self, x: Any) -> jax.Array:
        return jax.device_put(x, self._replicated)

    def _count_array(self, n: int) -> jax.Array:
        """A step's real sample count as a replicated scalar (cached: full batches repeat it)."""
        arr = self._counts.get(n)
        if arr is None:
            if len(self._counts) > 64:
                self._counts.clear()
            arr = self._counts[n] = self._put_replicated(np.float32(n))
        return arr

    @property
    def _local_replica_ids(self) -> list[int]:
        me = jax.process_index()
        return [i for i, d in enumerate(self._devices) if d.process_index == me]

    def _place_split(self, local: list[np.ndarray], global_rows: int) -> list[jax.Array]:
        """Global arrays split over replicas from this process's rows (all rows when single-process)."""
        if jax.process_count() == 1:
            return jax.device_put(local, self._split)
        return [jax.make_array_from_process_local_data(self._split, x, (global_rows, *x.shape[1:])) for x in local]

    def _distribute_batch(self, batch: Any, padded_size: int | None = None) -> DistributedBatch:
        """Splits one global batch (a pytree of arrays, the same on every worker) across replicas,
        padded, with a mask. Each worker keeps only the rows of its own replicas."""
        leaves, treedef = jax.tree.flatten(batch)
        if not leaves:
            raise ValueError(f"`batch` must hold at least one array, got {batch!r}.")
        leaves = [_to_numpy(x) for x in leaves]
        n = _batch_length(leaves)
        r = self.num_replicas_in_sync
        size = max(padded_size or 0, math.ceil(n / r) * r)
        size = math.ceil(size / r) * r
        b = size // r
        ids = self._local_replica_ids
        lo, hi = ids[0] * b, (ids[-1] + 1) * b  # a process's replicas are contiguous in the mesh
        if lo == 0 and hi <= n:
            local = [x[:hi] for x in leaves]
        else:  # padding repeats the first row: padding stays valid input (labels in range, no log(0))
            idx = np.arange(lo, hi)
            idx = np.where(idx < n, idx, 0)
            local = [np.take(x, idx, axis=0) for x in leaves]
        key = (lo, hi, n, size)
        layout = self._masks.get(key)  # full batches repeat one mask and layout: build and place them once
        if layout is None:
            if len(self._masks) > 64:
                self._masks.clear()
            mask = self._place_split([(np.arange(lo, hi) < n).astype(np.float32)], size)[0]
            layout = self._masks[key] = (mask, StepInfo.contiguous(r, b, n))
        return DistributedBatch(self._place_split(local, size), treedef, layout[0], layout[1], self)

    def _replicas_per_process(self) -> list[int]:
        counts = collections.Counter(d.process_index for d in self._devices)
        return [counts[p] for p in range(jax.process_count())]

    def _allgather_counts(self, n: int) -> np.ndarray:
        """Every worker's local batch size this step (one small collective across workers)."""
        if jax.process_count() == 1:
            return np.array([n])
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(np.array([n], np.int64))).reshape(-1)

    def _distribute_local_batches(self, dataset: Iterable[Any]) -> Iterator[DistributedBatch]:
        """Per-worker pipelines: agree on sizes each step; a finished worker sends padding only."""
        it = iter(dataset)
        template: list[np.ndarray] | None = None
        treedef: Any = None
        per_replica = 0
        local_replicas = self._replicas_per_process()
        mine = local_replicas[jax.process_index()]
        while True:
            batch = next(it, None)
            if batch is not None:
                leaves, treedef = jax.tree.flatten(batch)
                leaves = [_to_numpy(x) for x in leaves]
                n = _batch_length(leaves)
                if template is None:
                    template = [x[:1] for x in leaves]
            else:
                n = 0
            sizes = self._allgather_counts(n)
            if not sizes.any():
                return
            if template is None:
                raise ValueError(f"worker {jax.process_index()}'s pipeline yielded no batch while other workers' "
                                 "did: give every worker at least one batch.")
            per_replica = max(per_replica, *(math.ceil(int(k) / r) for k, r in zip(sizes, local_replicas)))
            rows = mine * per_replica
            source = leaves if n else template
            idx = np.where(np.arange(rows) < n, np.arange(rows), 0)
            local = [np.take(x, idx, axis=0) for x in source]
            mask = (np.arange(rows) < n).astype(np.float32)
            counts = np.concatenate([np.clip(int(k) - np.arange(r) * per_replica, 0, per_replica)
                                     for k, r in zip(sizes, local_replicas)])
            total = self.num_replicas_in_sync * per_replica
            placed = self._place_split([*local, mask], total)
            yield DistributedBatch(placed[:-1], treedef, placed[-1],
                                   StepInfo(self.num_replicas_in_sync, per_replica, counts), self)

    # --- datasets ----------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Iterable[Any]) -> "DistributedDataset":
        """Wraps an iterable of *global* batches so each batch is split across replicas.

        Any iterable of pytrees of arrays works: `lockstep.data.batches`, a generator, a
        `tf.data.Dataset`, a PyTorch `DataLoader`. A short last batch is padded to the shape
        of the first batch and carries a mask, so one compiled step serves every batch.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(4)
        >>> ds = s.experimental_distribute_dataset(ls.data.batches(np.arange(10.0), batch_size=4))
        >>> [b.num_real for b in ds]
        [4, 4, 2]
        """
        if not isinstance(dataset, Iterable):
            raise TypeError(f"`dataset` must be an iterable of batches, got {type(dataset).__name__}.")
        return DistributedDataset(self, dataset)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]]
                                          ) -> "DistributedDataset":
        """Calls `dataset_fn(InputContext)` on each worker; it returns that worker's batches.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(2)
        >>> ds = s.distribute_datasets_from_function(
        ...     lambda ctx: ls.data.batches(np.arange(5.0), batch_size=2))
        >>> [b.num_real for b in ds]
        [2, 2, 1]
        """
        if not callable(dataset_fn):
            raise TypeError(f"`dataset_fn` must be callable, got {type(dataset_fn).__name__}.")
        ctx = InputContext(jax.process_count(), jax.process_index(), self.num_replicas_in_sync)
        dataset = dataset_fn(ctx)
        if not isinstance(dataset, Iterable):
            raise TypeError(f"`dataset_fn` must return an iterable of batches, got {type(dataset).__name__}.")
        return DistributedDataset(self, dataset, per_worker=True)

    def experimental_distribute_values_from_function(self, value_fn: Callable[["ValueContext"], Any]) -> Any:
        """A per-replica value made by calling `value_fn(ValueContext)` once per replica.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(3)
        >>> v = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
        >>> [float(x) for x in s.experimental_local_results(v)]
        [0.0, 1.0, 2.0]
        """
        if not callable(value_fn):
            raise TypeError(f"`value_fn` must be callable, got {type(value_fn).__name__}.")
        n = self.num_replicas_in_sync
        per = [value_fn(ValueContext(i, n)) for i in self._local_replica_ids]
        leaves0, treedef = jax.tree.flatten(per[0])
        columns = [jax.tree.leaves(p) for p in per]
        out = []
        for j in range(len(leaves0)):
            stacked = np.stack([np.asarray(c[j]) for c in columns])
            if jax.process_count() == 1:
                arr = jax.device_put(stacked, self._split)
            else:
                arr = jax.make_array_from_process_local_data(self._split, stacked, (n, *stacked.shape[1:]))
            out.append(PerReplica(arr, self))
        return jax.tree.unflatten(treedef, out)

    # --- run ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Any = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Runs `fn` once per replica, compiled, and returns its outputs as distributed values.

        Arguments may hold: a `DistributedBatch` (each replica gets its rows; the mask is on
        `get_replica_context().mask`), `PerReplica` values (each replica gets its own), and
        arrays (NumPy, JAX), which every replica gets whole. Other leaves — Python scalars such as
        a `training=True` flag, strings — are static, as in `tf.distribute`: a new value compiles
        a new step.
        Outputs come back in `fn`'s structure: `Mirrored` leaves where the value is the same on
        every replica by construction, `PerReplica` leaves otherwise.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(2)
        >>> batch = next(iter(s.experimental_distribute_dataset([np.arange(4.0)])))
        >>> out = s.run(lambda b: b * 2, args=(batch,))
        >>> s.experimental_local_results(out)
        (Array([0., 2.], dtype=float32), Array([4., 6.], dtype=float32))
        """
        if not callable(fn):
            raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
        if not isinstance(args, (tuple, list)):
            args = (args,)
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"`kwargs` must be a dict or None, got {type(kwargs).__name__}.")
        leaves, treedef = jax.tree.flatten((tuple(args), kwargs))  # distributed values are pytree leaves
        kinds: list[str] = []
        dyn: list[Any] = []
        statics: list[Any] = []
        batch: DistributedBatch | None = None
        for leaf in leaves:
            if isinstance(leaf, DistributedBatch):
                self._check_owner(leaf, "args")
                if batch is not None and leaf is not batch:
                    raise ValueError("`args` may hold one distributed batch per `run`, got two.")
                batch = leaf
                kinds.append("batch")
            elif isinstance(leaf, PerReplica):
                self._check_owner(leaf, "args")
                kinds.append("per_replica")
                dyn.append(leaf._array)
            elif isinstance(leaf, Mirrored):
                self._check_owner(leaf, "args")
                kinds.append("replicated")
                dyn.append(leaf._array)
            elif isinstance(leaf, _ARRAY_TYPES):
                kinds.append("replicated")
                dyn.append(leaf)
            else:
                kinds.append("static")
                statics.append(leaf)
        batch_leaves = [] if batch is None else list(batch._leaves)
        mask = [] if batch is None else [batch._mask, batch._count]
        try:
            static_key = tuple(statics)
            hash(static_key)
        except TypeError:
            raise TypeError(
                f"`args` leaves that are not arrays must be hashable (they are compiled in), "
                f"got {[type(s).__name__ for s in statics]}."
            ) from None
        sig = tuple(_signature(x) for x in (*batch_leaves, *dyn))
        key = (fn, treedef, tuple(kinds), None if batch is None else batch._treedef, static_key, sig)
        with self._lock:
            entry = self._runs.get(key)
            if entry is None:
                if len(self._runs) > 256:
                    self._runs.clear()
                entry = self._runs[key] = self._compile_run(
                    fn, treedef, kinds, statics, None if batch is None else batch._treedef,
                    batch_leaves, mask, dyn)
        assert entry.call is not None and entry.flags is not None
        outs = entry.call(batch_leaves, mask, dyn)
        step = None if batch is None else batch._step
        wrapped = [Mirrored(o, self) if m else PerReplica(o, self, step) for o, m in zip(outs, entry.flags)]
        if outs:
            self._track(outs[0])
        return jax.tree.unflatten(entry.out_tree, wrapped)

    def _call(self, fn: Callable[..., Any], *args: Any, **static: Any) -> jax.Array:
        """`fn` compiled with a result replicated on every device (readable on every worker)."""
        key = (fn, tuple(sorted(static)))
        jitted = self._helpers.get(key)
        if jitted is None:
            jitted = self._helpers[key] = jax.jit(fn, static_argnames=tuple(static), out_shardings=self._replicated)
        return jitted(*args, **static)

    def _track(self, token: jax.Array) -> None:
        """Bounds the compiled steps in flight (DESIGN.md's CPU deadlock)."""
        self._in_flight.append(token)
        while len(self._in_flight) > MAX_STEPS_IN_FLIGHT:
            self._in_flight.popleft().block_until_ready()

    def _compile_run(self, fn: Callable[..., Any], treedef: Any, kinds: list[str], statics: list[Any],
                     batch_treedef: Any, batch_leaves: list[Any], mask: list[Any], dyn: list[Any]) -> _RunEntry:
        entry = _RunEntry()
        has_batch = batch_treedef is not None

        def body(flags: tuple[bool, ...] | None, b_leaves: list[jax.Array], m: list[jax.Array],
                 d: list[jax.Array]) -> tuple[jax.Array, ...]:
            d_it, s_it = iter(d), iter(statics)
            rebuilt = []
            for kind in kinds:
                if kind == "batch":
                    rebuilt.append(jax.tree.unflatten(batch_treedef, b_leaves))
                elif kind == "per_replica":
                    rebuilt.append(next(d_it)[0])
                elif kind == "replicated":
                    rebuilt.append(next(d_it))
                else:
                    rebuilt.append(next(s_it))
            args, kwargs = jax.tree.unflatten(treedef, rebuilt)
            ctx = ReplicaContext(self, m[0], m[1]) if has_batch else ReplicaContext(self, None)
            with replica_context(ctx):
                out = fn(*args, **kwargs)
            out_leaves, entry.out_tree = jax.tree.flatten(out)
            try:
                out_leaves = [jnp.asarray(o) for o in out_leaves]
            except TypeError as e:
                raise TypeError(f"`fn` must return a pytree of arrays; {e}") from None
            if flags is None:
                entry.flags = tuple(not _varies(o) for o in out_leaves)
                return tuple(o[None] for o in out_leaves)
            return tuple(o if mirrored else o[None] for o, mirrored in zip(out_leaves, flags))

        in_specs = ([P(AXIS)] * len(batch_leaves), [P(AXIS), P()][:len(mask)],
                    [P(AXIS) if k == "per_replica" else P() for k in kinds if k in ("per_replica", "replicated")])
        probe = jax.shard_map(functools.partial(body, None), mesh=self._mesh, in_specs=in_specs,
                              out_specs=P(AXIS))
        jax.eval_shape(probe, batch_leaves, mask, dyn)
        flags = entry.flags
        assert flags is not None
        out_specs = tuple(P() if m else P(AXIS) for m in flags)
        entry.call = jax.jit(jax.shard_map(functools.partial(body, flags), mesh=self._mesh,
                                           in_specs=in_specs, out_specs=out_specs))
        return entry

    # --- reading distributed values ----------------------------------------------------
    def _as_leaves(self, value: Any, arg: str) -> Any:
        """Turns distributed batches into per-replica leaves of shape (R, b, ...)."""
        def expand(v: Any) -> Any:
            if isinstance(v, DistributedBatch):
                self._check_owner(v, arg)
                r = self.num_replicas_in_sync
                return jax.tree.map(lambda a: PerReplica(_split_rows(a, r), self, v._step), v.data)
            if isinstance(v, (PerReplica, Mirrored)):
                self._check_owner(v, arg)
            return v
        return jax.tree.map(expand, value, is_leaf=is_distributed)

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines a distributed value across replicas (and, with `axis=0`, across its batch axis).

        With `axis=None`, `MEAN` weighs each replica by its real samples in the step that made
        the value (replicas holding only padding are left out); `SUM`, `MAX`, `MIN` combine all
        replicas. With `axis=0`, a per-replica value whose leading dimension is the step's
        per-replica batch size is masked row by row, so padding rows never count.

        Args:
          op: a `ReduceOp` (or its name).
          value: a pytree of `PerReplica` / `Mirrored` values (plain arrays count as mirrored).
          axis: `None` to combine across replicas only; `0` to reduce the batch axis too.

        Returns:
          A pytree of arrays, the same on every worker.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(4)
        >>> batch = next(iter(s.experimental_distribute_dataset([np.arange(5.0)])))
        >>> float(s.reduce("MEAN", s.run(lambda b: b, args=(batch,)), axis=0))   # padding ignored
        2.0
        """
        op = ReduceOp.from_value(op)
        if axis not in (None, 0):
            raise ValueError(f"`axis` must be None or 0, got axis={axis!r}.")
        value = self._as_leaves(value, "value")
        return jax.tree.map(lambda v: self._reduce_leaf(op, v, axis), value, is_leaf=is_distributed)

    def _reduce_leaf(self, op: ReduceOp, v: Any, axis: int | None) -> jax.Array:
        r = self.num_replicas_in_sync
        if isinstance(v, PerReplica):
            stacked, step = v._array, v._step
        else:
            arr = v._array if isinstance(v, Mirrored) else jnp.asarray(v)
            if axis == 0 and arr.ndim == 0:
                raise ValueError("`axis=0` needs values with a batch axis, got a scalar.")
            if op is ReduceOp.SUM:
                return arr.sum(0) * r if axis == 0 else arr * r
            if op is ReduceOp.MEAN:
                return arr.mean(0) if axis == 0 else arr
            return (arr.max(0) if op is ReduceOp.MAX else arr.min(0)) if axis == 0 else arr
        if axis == 0 and stacked.ndim < 2:
            raise ValueError("`axis=0` needs per-replica values with a batch axis, got scalars per replica.")
        if axis is None:
            weights = np.ones(r, np.float32) if step is None else step.counts.astype(np.float32)
            return self._call(_reduce_replicas, stacked, weights, op=op)
        rows = stacked.shape[1]
        if step is not None and rows == step.per_replica:
            row_mask = step.row_mask
        else:
            row_mask = np.ones((r, rows), bool)
        return self._call(_reduce_rows, stacked, row_mask, op=op)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates per-replica values along `axis`; padding rows of batch-aligned values are dropped.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(4)
        >>> batch = next(iter(s.experimental_distribute_dataset([np.arange(5.0)])))
        >>> s.gather(s.run(lambda b: b + 1, args=(batch,)))
        Array([1., 2., 3., 4., 5.], dtype=float32)
        """
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise TypeError(f"`axis` must be an int, got axis={axis!r}.")
        value = self._as_leaves(value, "value")
        return jax.tree.map(lambda v: self._gather_leaf(v, axis), value, is_leaf=is_distributed)

    def _gather_leaf(self, v: Any, axis: int) -> jax.Array:
        r = self.num_replicas_in_sync
        if not isinstance(v, PerReplica):
            arr = v._array if isinstance(v, Mirrored) else jnp.asarray(v)
            return jnp.concatenate([arr] * r, axis=axis)
        stacked, step = v._array, v._step
        if stacked.ndim < 2:
            raise ValueError("`gather` needs per-replica values with at least one axis, got scalars per replica.")
        if axis == 0 and step is not None and stacked.shape[1] == step.per_replica:
            return self._call(_take_rows, stacked, np.flatnonzero(step.row_mask.reshape(-1)))
        return self._call(_concat_replicas, stacked, axis=axis)

    def experimental_local_results(self, value: Any) -> Any:
        """Each leaf as a tuple with one entry per local replica, in replica order.

        A mirrored leaf gives its value once per local replica, as in `tf.distribute`.
        """
        value = self._as_leaves(value, "value")

        def local(v: Any) -> Any:
            n_local = len(self._local_devices)
            if isinstance(v, PerReplica):
                shards = sorted(v._array.addressable_shards, key=lambda s: s.index[0].start or 0)
                return tuple(s.data[0] for s in shards)
            if isinstance(v, Mirrored):
                return (v._array,) * n_local
            return (v,) * n_local
        return jax.tree.map(local, value, is_leaf=is_distributed)


def _batch_length(leaves: list[np.ndarray]) -> int:
    lengths = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(lengths) != 1 or -1 in lengths:
        shapes = [np.shape(x) for x in leaves]
        raise ValueError(f"every array of a batch must have the same leading (batch) dimension, got shapes {shapes}.")
    n = lengths.pop()
    if n < 1:
        raise ValueError("a batch must hold at least one sample, got an empty batch.")
    return n


def _signature(x: Any) -> Any:
    try:
        return (x.shape, x.dtype)  # arrays (dtype objects hash fast; str() of them does not)
    except AttributeError:
        return (type(x),)


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu()
    return np.asarray(x)


@functools.partial(jax.jit, static_argnums=1)
def _split_rows(a: jax.Array, r: int) -> jax.Array:
    return a.reshape(r, a.shape[0] // r, *a.shape[1:])


def _reduce_replicas(stacked: jax.Array, weights: jax.Array, *, op: ReduceOp) -> jax.Array:
    if op is ReduceOp.SUM:
        return jnp.sum(stacked, axis=0)
    if op is ReduceOp.MAX:
        return jnp.max(stacked, axis=0)
    if op is ReduceOp.MIN:
        return jnp.min(stacked, axis=0)
    w = weights.reshape((-1,) + (1,) * (stacked.ndim - 1)).astype(jnp.result_type(stacked, jnp.float32))
    return jnp.sum(jnp.where(w > 0, stacked * w, 0), axis=0) / jnp.sum(weights)


def _reduce_rows(stacked: jax.Array, row_mask: jax.Array, *, op: ReduceOp) -> jax.Array:
    m = row_mask.reshape(row_mask.shape + (1,) * (stacked.ndim - 2))
    if op is ReduceOp.SUM:
        return jnp.sum(jnp.where(m, stacked, 0), axis=(0, 1))
    if op is ReduceOp.MEAN:
        total = jnp.sum(jnp.where(m, stacked, 0).astype(jnp.result_type(stacked, jnp.float32)), axis=(0, 1))
        return total / jnp.sum(row_mask)
    if op is ReduceOp.MAX:
        return jnp.max(jnp.where(m, stacked, _lowest(stacked.dtype)), axis=(0, 1))
    return jnp.min(jnp.where(m, stacked, _highest(stacked.dtype)), axis=(0, 1))


def _take_rows(stacked: jax.Array, idx: jax.Array) -> jax.Array:
    flat = stacked.reshape(-1, *stacked.shape[2:])
    return jnp.take(flat, idx, axis=0)


def _concat_replicas(stacked: jax.Array, *, axis: int) -> jax.Array:
    return jnp.concatenate(list(stacked), axis=axis)


#: Global batches prepared (sliced, padded, placed on the devices) ahead of the step that uses
#: them, in a background thread, so host work overlaps device work. 0 turns it off; unset, it is
#: 2 on accelerators and 0 on CPU devices, where the "device" work runs on the same cores and a
#: second Python thread only contends for them (and for the GIL).
PREFETCH = os.environ.get("LOCKSTEP_PREFETCH")


def _prefetch_depth(devices: list[jax.Device]) -> int:
    if PREFETCH is not None:
        return int(PREFETCH)
    return 0 if all(d.platform == "cpu" for d in devices) else 2

_DONE = object()


def _prefetch(source: Iterator[Any], depth: int) -> Iterator[Any]:
    """Runs `source` in a background thread, `depth` items ahead; errors surface in the consumer."""
    items: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        items.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put((True, _DONE))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            items.put((False, e))

    thread = threading.Thread(target=produce, name="lockstep-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = items.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=5.0)


class DistributedDataset:
    """An iterable of `DistributedBatch`es.

    Made by `experimental_distribute_dataset` (every worker iterates the same *global* batches
    and keeps its replicas' rows) or by `distribute_datasets_from_function` (each worker has its
    own pipeline of *local* batches; per step, the workers agree on a padded size, and a worker
    whose pipeline ran out contributes a batch of padding only, so all take the same steps).
    """

    def __init__(self, strategy: Strategy, dataset: Iterable[Any], per_worker: bool = False,
                 padded_size: int | None = None):
        self._strategy = strategy
        self._dataset = dataset
        self._per_worker = per_worker
        self._padded_size = padded_size

    def __iter__(self) -> Iterator[DistributedBatch]:
        if self._per_worker:
            yield from self._strategy._distribute_local_batches(self._dataset)
            return
        batches = self._distributed()
        depth = _prefetch_depth(self._strategy._devices)
        if jax.process_count() == 1 and depth > 0:
            batches = _prefetch(batches, depth)
        yield from batches

    def _distributed(self) -> Iterator[DistributedBatch]:
        padded = self._padded_size
        for batch in self._dataset:
            dist = self._strategy._distribute_batch(batch, padded)
            if padded is None:
                padded = dist._step.per_replica * dist._step.num_replicas
            yield dist

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]


# --- concrete strategies ---------------------------------------------------------------
def _resolve_device(d: Any, arg: str) -> jax.Device:
    if isinstance(d, jax.Device):
        return d
    if isinstance(d, int) and not isinstance(d, bool):
        devs = jax.local_devices()
        if not 0 <= d < len(devs):
            raise ValueError(f"`{arg}` names device index {d}, but there are {len(devs)} local devices.")
        return devs[d]
    if isinstance(d, str):
        text = d.strip().lstrip("/").lower().replace("device:", "")
        kind, _, idx = text.partition(":")
        kind = {"gpu": "gpu", "cuda": "gpu", "cpu": "cpu", "tpu": "tpu"}.get(kind, kind)
        try:
            devs = jax.local_devices(backend=kind)
            return devs[int(idx or 0)]
        except (RuntimeError, ValueError, IndexError):
            raise ValueError(f"`{arg}` names no local device: got {d!r}.") from None
    raise TypeError(f"`{arg}` must be a jax.Device, an int index or a string like 'cpu:0', got {d!r}.")


class OneDeviceStrategy(Strategy):
    """Runs every step on one device; the same API as the multi-replica strategies.

    >>> import lockstep as ls
    >>> ls.OneDeviceStrategy().num_replicas_in_sync
    1
    """

    def __init__(self, device: Any = None):
        super().__init__([jax.local_devices()[0] if device is None else _resolve_device(device, "device")])


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the local devices of this process.

    Args:
      devices: `None` for all local devices, an int `n` for the first `n`, or a list of
        devices (`jax.Device`, index, or names like ``"cpu:0"``).

    >>> import lockstep as ls
    >>> ls.MirroredStrategy(3).num_replicas_in_sync
    3
    """

    def __init__(self, devices: int | Sequence[Any] | None = None):
        local = jax.local_devices()
        if devices is None:
            chosen = list(local)
        elif isinstance(devices, int) and not isinstance(devices, bool):
            if not 1 <= devices <= len(local):
                raise ValueError(
                    f"`devices` must be between 1 and the {len(local)} local devices, got devices={devices}. "
                    "On a CPU, `lockstep.simulate_cpu_devices(n)` before JAX starts gives n devices."
                )
            chosen = list(local[:devices])
        elif isinstance(devices, (list, tuple)):
            if not devices:
                raise ValueError("`devices` must name at least one device, got an empty list.")
            chosen = [_resolve_device(d, "devices") for d in devices]
            if len(set(chosen)) != len(chosen):
                raise ValueError(f"`devices` names a device twice: got {devices!r}.")
        else:
            raise TypeError(f"`devices` must be None, an int or a list of devices, got {devices!r}.")
        super().__init__(chosen)


_NO_KERAS = object()


def _enter_keras_distribution(strategy: "Strategy") -> Any:
    """Sets Keras' distribution to data parallelism over `strategy`'s devices (only when Keras,
    on the JAX backend, is already imported); returns the previous one."""
    keras = sys.modules.get("keras")
    if keras is None and os.environ.get("KERAS_BACKEND") == "jax":
        import keras  # the user asked for Keras on JAX: models may be built inside this scope
    if keras is None or keras.backend.backend() != "jax":
        return _NO_KERAS
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=list(strategy.devices)))
    return previous


def _exit_keras_distribution(previous: Any) -> None:
    if previous is not _NO_KERAS:
        sys.modules["keras"].distribution.set_distribution(previous)


def strategy_of_devices(devices: Iterable[Any]) -> "Strategy | None":
    """The most recently entered scope's strategy whose devices are exactly `devices`."""
    wanted = set(devices)
    for ref in reversed(_RECENT):
        strategy = ref()
        if strategy is not None and set(strategy.devices) == wanted:
            return strategy
    return None


_RECENT: list[weakref.ReferenceType[Strategy]] = []


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[Strategy] = []


_SCOPES = _Scopes()
_DEFAULT: list[Strategy] = []


def get_strategy() -> Strategy:
    """The strategy of the innermost active `scope()`, else a default `OneDeviceStrategy`.

    >>> import lockstep as ls
    >>> ls.get_strategy().num_replicas_in_sync
    1
    """
    if _SCOPES.stack:
        return _SCOPES.stack[-1]
    if not _DEFAULT:
        _DEFAULT.append(OneDeviceStrategy())
    return _DEFAULT[0]
