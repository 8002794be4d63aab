"""Strategies: the public `tf.distribute`-style face (`Strategy`, `OneDeviceStrategy`,
`MirroredStrategy`, `TPUStrategy`) over the engine (`lockstep.engine`).

`Strategy` turns distributed values (`_values`) and datasets (`_datasets`) into plain arrays for
the engine and the results back into distributed values; scopes are `_scope`'s;
`strategy.extended` is the engine itself, which lockstep's own code (the `Trainer`) drives on
plain arrays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .._errors import UsageError
from ..data import IterableBatches, ReplicaBatches, adapt
from ..engine import BATCH_AXIS, gather_stacked, note_new_function, reduce_replicated, reduce_stacked, split_rows
from ..engine import DistributedBatch, RecordingFunction, ReduceOp, get_replica_context
from ..sharding import ShardingConfig
from . import _scope
from ._cross_device_ops import checked_cross_device_ops
from ._datasets import DistributedDataset, InputContext
from ._extended import StrategyExtended
from ._values import Mirrored, PerReplica, engine_of, is_distributed, step_of, unwrap


class ValueContext:
    """What `experimental_distribute_values_from_function`'s function knows: which replica it builds for."""

    def __init__(self, replica_id_in_sync_group: int, num_replicas_in_sync: int):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync


class Strategy:
    """Synchronous data parallelism over a 1-D mesh of `devices` (axis name ``"batch"``), or over
    the axis `batch_axis` of `mesh` (a `jax.sharding.Mesh` with named axes).

    Use a subclass: `OneDeviceStrategy`, `MirroredStrategy` or `MultiWorkerMirroredStrategy`.
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None, *, mesh: Mesh | None = None,
                 batch_axis: str | tuple[str, ...] = BATCH_AXIS, sharding: ShardingConfig | None = None):
        _scope.check_keras_backend()
        self._extended = StrategyExtended(None if devices is None else tuple(devices), owner=self, mesh=mesh,
                                          batch_axis=batch_axis, sharding=sharding)
        self._devices = tuple(self._extended.mesh.devices.flat)

    # --- facts -------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas taking part in each step, over all workers."""
        return self._extended.num_replicas

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    @property
    def mesh(self) -> Mesh:
        """The `jax.sharding.Mesh` that steps run on (1-D, axis ``"batch"``, unless given)."""
        return self._extended.mesh

    @property
    def extended(self) -> StrategyExtended:
        """The engine on plain arrays (as `tf.distribute`'s ``strategy.extended``)."""
        return self._extended

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"

    # --- scope -------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this strategy the one `get_strategy()` returns inside the block.

        A Keras 3 model built inside the block gets its variables replicated on this strategy's
        devices (Keras' distribution there is a `DataParallel` over them, unless one was set with
        `keras.distribution.set_distribution`: `lockstep.keras`), and a `Trainer` made
        later for that model, outside any scope, runs on this strategy — as in `tf.distribute`.

        >>> import lockstep as ls
        >>> s = ls.MirroredStrategy(2)
        >>> with s.scope():
        ...     ls.get_strategy() is s
        True
        """
        with _scope.entered(self):
            yield self

    # --- checks ------------------------------------------------------------------------
    def _check_owner(self, value: Any, arg: str) -> None:
        owner = engine_of(value).owner
        if engine_of(value) is not self._extended:
            raise ValueError(
                f"`{arg}` holds a {type(value).__name__} value made by {owner!r}, "
                f"but this call is on another strategy, {self!r}. Distributed values are bound "
                "to the strategy whose `run` or dataset made them."
            )

    # --- datasets ----------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Iterable[Any]) -> DistributedDataset:
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
        return DistributedDataset(self._extended, adapt(dataset, arg="dataset", global_batches=True))

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]]
                                          ) -> DistributedDataset:
        """Calls `dataset_fn(InputContext)` on each worker; it returns that worker's *per-replica*
        batches, as in TF: batch with ``ctx.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)``.

        Each step a worker takes one batch for each of its local replicas (so a step of the whole
        job holds `num_replicas_in_sync` of them); workers whose pipelines run out early send
        padding, so every row counts once. Any iterable works (a `tf.data.Dataset`, a list, a
        generator); `fit` / `evaluate` / `predict` take the result.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(2)
        >>> ds = s.distribute_datasets_from_function(
        ...     lambda ctx: ls.data.batches(np.arange(5.0), batch_size=ctx.get_per_replica_batch_size(4)))
        >>> [b.num_real for b in ds]
        [4, 1]
        """
        if not callable(dataset_fn):
            raise TypeError(f"`dataset_fn` must be callable, got {type(dataset_fn).__name__}.")
        ctx = InputContext(jax.process_count(), jax.process_index(), self.num_replicas_in_sync)
        dataset = dataset_fn(ctx)
        if not isinstance(dataset, Iterable):
            raise TypeError(f"`dataset_fn` must return an iterable of batches, got {type(dataset).__name__}.")
        per_worker = ReplicaBatches(dataset, self._extended.num_local_replicas)
        return DistributedDataset(self._extended, IterableBatches(per_worker, per_worker=True))

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
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
        distributor = self._extended.distributor
        per = [value_fn(ValueContext(i, n)) for i in distributor.local_replica_ids]
        leaves0, treedef = jax.tree.flatten(per[0])
        columns = [jax.tree.leaves(p) for p in per]
        stacked = [np.stack([np.asarray(c[j]) for c in columns]) for j in range(len(leaves0))]
        placed = distributor.place_split(stacked, n)
        return jax.tree.unflatten(treedef, [PerReplica(a, self._extended) for a in placed])

    # --- run ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Any = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Runs `fn` once per replica, compiled, and returns its outputs as distributed values.

        Arguments may hold: a distributed batch (each replica gets its rows; the mask is on
        `get_replica_context().mask`), `PerReplica` values (each replica gets its own), and
        arrays (NumPy, JAX), which every replica gets whole. Other leaves — Python scalars such as
        a `training=True` flag, strings — are static, as in `tf.distribute`: a new value compiles
        a new step.
        Outputs come back in `fn`'s structure: `Mirrored` leaves where the value is the same on
        every replica by construction, `PerReplica` leaves otherwise.

        Raises:
          UsageError: called inside another `run` (nested runs are not supported).

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(2)
        >>> batch = next(iter(s.experimental_distribute_dataset([np.arange(4.0)])))
        >>> out = s.run(lambda b: b * 2, args=(batch,))
        >>> s.experimental_local_results(out)
        (Array([0., 2.], dtype=float32), Array([4., 6.], dtype=float32))
        """
        if not callable(fn):
            raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
        if get_replica_context() is not None:
            raise UsageError("`strategy.run` was called inside another `strategy.run`: call the inner function "
                             "directly (it already runs once per replica).")
        if not isinstance(args, (tuple, list)):
            args = (args,)
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"`kwargs` must be a dict or None, got {type(kwargs).__name__}.")
        note_new_function(fn, self)  # a new function object compiles anew: warned when one code keeps coming so
        leaves, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=is_distributed)
        plain, kinds, batch = self._plain_leaves(leaves)
        call_args = jax.tree.unflatten(treedef, plain)
        call_kinds = jax.tree.unflatten(treedef, kinds)
        # what `fn` updates (Keras metrics) comes back beside its outputs, and is applied after the call
        (out, recorded), flags = self._extended.run_inferred(
            RecordingFunction(fn), call_args, call_kinds, None if batch is None else batch.mask,
            None if batch is None else batch.count, with_kwargs=True)
        recorded.apply()
        out_leaves, out_tree = jax.tree.flatten(out)
        step = None if batch is None else batch.step
        wrapped = [Mirrored(o, self._extended) if m else PerReplica(o, self._extended, step) for o, m in zip(out_leaves, flags)]
        return jax.tree.unflatten(out_tree, wrapped)

    def _plain_leaves(self, leaves: list[Any]) -> tuple[list[Any], list[str], DistributedBatch | None]:
        """`run`'s argument leaves as plain arrays with their kinds, and the distributed batch if any."""
        plain: list[Any] = []
        kinds: list[str] = []
        batch: DistributedBatch | None = None
        for leaf in leaves:
            kind = "replicated"
            if is_distributed(leaf):
                self._check_owner(leaf, "args")
            if isinstance(leaf, DistributedBatch):
                if batch is not None and leaf.origin is not batch.origin:
                    raise ValueError("`args` may hold parts of one distributed batch per `run`, got two batches.")
                batch, kind, leaf = leaf, "rows", leaf.data
            elif isinstance(leaf, PerReplica):
                kind, leaf = "per_replica", unwrap(leaf)
            elif isinstance(leaf, Mirrored):
                leaf = unwrap(leaf)
            plain.append(leaf)
            kinds.append(kind)
        return plain, kinds, batch

    # --- reading distributed values ----------------------------------------------------
    def _as_leaves(self, value: Any, arg: str, caller: str) -> Any:
        """Turns distributed batches into per-replica leaves of shape (R, b, ...).

        Raises `UsageError` inside `run`, where a replica's value is not a distributed value
        (TF raises there too; lockstep would otherwise reduce one replica's partial value).
        """
        if get_replica_context() is not None:
            instead = "all_gather" if caller != "reduce" else "all_reduce"
            raise UsageError(
                f"`strategy.{caller}` was called inside `strategy.run`, where each replica holds only its "
                f"own part: use `ls.get_replica_context().{instead}(...)` there, or call "
                f"`strategy.{caller}` on `run`'s outputs.")
        def expand(v: Any) -> Any:
            if is_distributed(v):
                self._check_owner(v, arg)
            if isinstance(v, DistributedBatch):
                r = self.num_replicas_in_sync
                return jax.tree.map(lambda a: PerReplica(split_rows(a, r), self._extended, v.step), v.data)
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

        def one(v: Any) -> jax.Array:
            if isinstance(v, PerReplica):
                return reduce_stacked(self._extended.replicated_call, op, unwrap(v), step_of(v), axis)
            if (op is ReduceOp.SUM and axis is None and not isinstance(v, Mirrored) and self.num_replicas_in_sync > 1
                    and np.any(np.asarray(v) != 0)):  # as TF: what would the sum of one plain value be?
                raise ValueError(
                    f"`value` holds a plain value ({np.asarray(v).tolist()!r}), not a distributed one, which cannot be "
                    f"reduced with ReduceOp.SUM over {self.num_replicas_in_sync} replicas (TF raises here too): "
                    "reduce what `strategy.run` returns, or multiply by `num_replicas_in_sync` yourself.")
            return reduce_replicated(op, jnp.asarray(unwrap(v)), self.num_replicas_in_sync, axis)
        return jax.tree.map(one, self._as_leaves(value, "value", "reduce"), is_leaf=is_distributed)

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

        def one(v: Any) -> jax.Array:
            if isinstance(v, PerReplica):
                return gather_stacked(self._extended.replicated_call, unwrap(v), step_of(v), axis)
            return jnp.concatenate([jnp.asarray(unwrap(v))] * self.num_replicas_in_sync, axis=axis)
        return jax.tree.map(one, self._as_leaves(value, "value", "gather"), is_leaf=is_distributed)

    def experimental_local_results(self, value: Any) -> Any:
        """This worker's replicas' values: a tuple with one entry per local replica, in replica order.

        As in `tf.distribute`, each entry is the whole structure of `value` as that replica holds
        it (a `Mirrored` leaf gives its value to every replica), and a plain value that is not
        distributed comes back as ``(value,)``. A batch's rows (and outputs row for row) are the
        replica's real rows only, as TF gives them: a replica that holds only padding gives 0 rows.

        >>> import lockstep as ls, numpy as np
        >>> s = ls.MirroredStrategy(2)
        >>> batch = next(iter(s.experimental_distribute_dataset([np.arange(4.0)])))
        >>> out = s.run(lambda b: {"x": b, "total": ls.get_replica_context().all_reduce("SUM", b.sum())}, args=(batch,))
        >>> [{k: v.tolist() for k, v in r.items()} for r in s.experimental_local_results(out)]
        [{'total': 6.0, 'x': [0.0, 1.0]}, {'total': 6.0, 'x': [2.0, 3.0]}]
        >>> short = next(iter(s.experimental_distribute_dataset([np.arange(1.0)])))
        >>> [r.tolist() for r in s.experimental_local_results(short)]
        [[0.0], []]
        """
        leaves, treedef = jax.tree.flatten(self._as_leaves(value, "value", "experimental_local_results"),
                                           is_leaf=is_distributed)
        if not any(is_distributed(v) for v in leaves):
            return (value,)
        n_local = self._extended.num_local_replicas
        columns = [_real_rows(v, self._extended.distributor.local_replica_ids) if isinstance(v, PerReplica)
                   else v.values if isinstance(v, Mirrored) else (v,) * n_local for v in leaves]
        return tuple(jax.tree.unflatten(treedef, [c[i] for c in columns]) for i in range(n_local))


def _real_rows(v: PerReplica, replica_ids: list[int]) -> tuple[jax.Array, ...]:
    """This worker's entries of `v`; those aligned with a batch's rows keep only the real ones."""
    step = step_of(v)
    entries = v.values
    if step is None or len(entries[0].shape) < 1 or entries[0].shape[0] != step.per_replica:
        return entries
    return tuple(e[:int(step.counts[r])] for e, r in zip(entries, replica_ids))


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
            have = ", ".join(f"{x.platform}:{i}" for i, x in enumerate(jax.local_devices()))
            raise ValueError(f"`{arg}` names no local device: got {d!r}; this machine has {have}. Pass None for "
                             "every local device (TF's GPU names port as they are where JAX sees those GPUs).") from None
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
      cross_device_ops: TF's choice of all-reduce (``ls.NcclAllReduce()``,
        ``ls.HierarchicalCopyAllReduce()``, TF's own objects too): accepted and recorded; the steps
        use XLA's all-reduce whatever it is (see `lockstep.distribute._cross_device_ops`).

    >>> import lockstep as ls
    >>> ls.MirroredStrategy(3).num_replicas_in_sync
    3
    """

    def __init__(self, devices: int | Sequence[Any] | None = None, cross_device_ops: Any = None):
        self.cross_device_ops = checked_cross_device_ops(cross_device_ops)
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


class CentralStorageStrategy(MirroredStrategy):
    """TF's `CentralStorageStrategy` (variables on one device, compute on the others) as
    `MirroredStrategy` over `compute_devices`: lockstep's steps equal one device's, so where the
    variables lie changes no number; `parameter_device` is accepted and recorded."""

    def __init__(self, compute_devices: int | Sequence[Any] | None = None, parameter_device: Any = None):
        super().__init__(compute_devices)
        self.parameter_device = parameter_device


_DEFAULT: list[Strategy] = []


def has_strategy() -> bool:
    """Whether a strategy's `scope()` is active (TF's ``tf.distribute.has_strategy``).

    >>> import lockstep as ls
    >>> ls.has_strategy(), ls.in_cross_replica_context()
    (False, False)
    >>> with ls.MirroredStrategy(2).scope():
    ...     ls.has_strategy(), ls.in_cross_replica_context()
    (True, True)
    """
    return _scope.active() is not None


def in_cross_replica_context() -> bool:
    """Whether this code runs in a strategy's scope outside a replica function (TF's
    ``tf.distribute.in_cross_replica_context``): inside `strategy.run`, False."""
    return has_strategy() and get_replica_context() is None


def get_strategy() -> Strategy:
    """The strategy of the innermost active `scope()`, else a default `OneDeviceStrategy`.

    >>> import lockstep as ls
    >>> ls.get_strategy().num_replicas_in_sync
    1
    """
    active = _scope.active()
    if active is not None:
        return active
    if not _DEFAULT:
        _DEFAULT.append(OneDeviceStrategy())
    return _DEFAULT[0]

