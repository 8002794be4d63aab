"""Distributed values (`PerReplica`, `Mirrored`, `DistributedBatch`) and the replica context."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ._reduce import ReduceOp

if TYPE_CHECKING:
    from ._strategy import Strategy

AXIS = "replica"


class StepInfo:
    """Host-side facts of one distributed batch: which rows of each replica are real.

    Known on the host when the batch is built (on every worker), so trimming padding never
    waits on a device. Replica `r` holds `counts[r]` real rows, then padding.
    """

    __slots__ = ("num_replicas", "per_replica", "num_real", "counts", "row_mask")

    def __init__(self, num_replicas: int, per_replica: int, counts: np.ndarray):
        self.num_replicas = num_replicas
        self.per_replica = per_replica
        self.counts = np.asarray(counts, np.int64)  # (R,)
        self.num_real = int(self.counts.sum())
        self.row_mask = np.arange(per_replica)[None, :] < self.counts[:, None]  # (R, b) bool

    @classmethod
    def contiguous(cls, num_replicas: int, per_replica: int, num_real: int) -> "StepInfo":
        """A global batch of `num_real` rows laid out replica after replica, padding at the end."""
        starts = np.arange(num_replicas) * per_replica
        return cls(num_replicas, per_replica, np.clip(num_real - starts, 0, per_replica))


class PerReplica:
    """One value per replica, held as a global array whose leading axis is the replica.

    Returned by `strategy.run` for outputs that differ between replicas. Pass it back into
    `run` (each replica gets its own entry), or read it with `strategy.reduce`,
    `strategy.gather` or `strategy.experimental_local_results`.
    """

    __slots__ = ("_array", "_strategy", "_step")

    def __init__(self, array: jax.Array, strategy: "Strategy", step: StepInfo | None = None):
        self._array = array
        self._strategy = strategy
        self._step = step

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """This process's replicas' values, in replica order."""
        return self._strategy.experimental_local_results(self)

    def __repr__(self) -> str:
        per = tuple(self._array.shape[1:])
        return f"PerReplica(num_replicas={self._array.shape[0]}, shape={per}, dtype={self._array.dtype})"


class Mirrored:
    """A value identical on every replica by construction (say, the result of an all-reduce)."""

    __slots__ = ("_array", "_strategy")

    def __init__(self, array: jax.Array, strategy: "Strategy"):
        self._array = array
        self._strategy = strategy

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """The value once per local replica, as in `tf.distribute`."""
        return self._strategy.experimental_local_results(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.asarray(self._array)
        return out.astype(dtype) if dtype is not None else out

    def __repr__(self) -> str:
        return f"Mirrored({self._array!r})"


class DistributedBatch:
    """One global batch split across replicas, padded to equal shapes, with a per-sample mask.

    Inside `strategy.run` the function receives `data`'s structure with each replica's rows
    (padding included); the mask is on `get_replica_context().mask`.
    """

    __slots__ = ("_leaves", "_treedef", "_mask", "_count", "_step", "_strategy")

    def __init__(self, leaves: list[jax.Array], treedef: Any, mask: jax.Array, step: StepInfo,
                 strategy: "Strategy", count: jax.Array | None = None):
        self._leaves = leaves
        self._treedef = treedef
        self._mask = mask
        self._step = step
        self._strategy = strategy
        # the step's real sample count over all replicas, known on the host: a replicated scalar,
        # so losses need no collective to find it
        self._count = count if count is not None else strategy._count_array(step.num_real)

    @property
    def data(self) -> Any:
        """The padded global batch, in the structure the dataset yielded."""
        return jax.tree.unflatten(self._treedef, self._leaves)

    @property
    def mask(self) -> jax.Array:
        """Per-sample mask of the padded global batch: 1.0 for real rows, 0.0 for padding."""
        return self._mask

    @property
    def num_real(self) -> int:
        """Number of real (not padding) samples in this global batch."""
        return self._step.num_real

    def __repr__(self) -> str:
        return (f"DistributedBatch(num_real={self.num_real}, padded={self._step.per_replica * self._step.num_replicas}, "
                f"replicas={self._step.num_replicas})")


def is_distributed(x: Any) -> bool:
    return isinstance(x, (PerReplica, Mirrored, DistributedBatch))


def raw(v: Any) -> Any:
    """The global array behind a `PerReplica` / `Mirrored` value; anything else as it is."""
    return v._array if isinstance(v, (PerReplica, Mirrored)) else v


def raw_tree(tree: Any) -> Any:
    """`tree` with every `PerReplica` / `Mirrored` leaf replaced by its global array."""
    return jax.tree.map(raw, tree, is_leaf=lambda v: isinstance(v, (PerReplica, Mirrored)))


def _varies(x: Any) -> bool:
    """Whether a traced value inside `shard_map` may differ between replicas."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return AXIS in mat.varying
    vma = getattr(aval, "vma", None)  # older JAX spelling
    return True if vma is None else AXIS in vma


def _to_varying(x: jax.Array) -> jax.Array:
    return jax.lax.pcast(x, AXIS, to="varying") if not _varies(x) else x


def _lowest(dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _highest(dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


class ReplicaContext:
    """What a function running inside `strategy.run` knows about its replica.

    Read it with `lockstep.get_replica_context()`; outside `run` that returns `None`.
    """

    def __init__(self, strategy: "Strategy", mask: jax.Array | None, global_count: jax.Array | None = None):
        self._strategy = strategy
        self._mask = mask
        self._global_count = global_count

    @property
    def strategy(self) -> "Strategy":
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        """This replica's index, 0 .. num_replicas_in_sync - 1 (a traced integer)."""
        return jax.lax.axis_index(AXIS)

    @property
    def mask(self) -> jax.Array | None:
        """This replica's per-sample mask (1.0 real, 0.0 padding) of the distributed batch in
        `run`'s arguments; `None` when `run` got no distributed batch."""
        return self._mask

    def global_count(self) -> jax.Array | None:
        """The real number of samples of the step's distributed batch over all replicas."""
        if self._mask is None:
            return None
        if self._global_count is not None:
            return self._global_count
        return jax.lax.psum(jnp.sum(self._mask), AXIS)

    def _local_count(self) -> jax.Array | None:
        return None if self._mask is None else jnp.sum(self._mask)

    def all_reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Combines `value` (a pytree) across replicas; every replica gets the result.

        `MEAN` weighs each replica by its number of real samples in the step (a replica that
        holds only padding is left out); `SUM`, `MAX` and `MIN` combine every replica.
        Note: gradients taken with respect to values that are the same on every replica
        (model parameters passed to `run`) already come back summed over replicas.
        """
        op = ReduceOp.from_value(op)
        count = self._local_count()
        return jax.tree.map(lambda v: _all_reduce_leaf(op, jnp.asarray(v), count), value)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates every replica's `value` along `axis` (padding rows included, shapes being static)."""
        return jax.tree.map(
            lambda v: jax.lax.all_gather(_to_varying(jnp.asarray(v)), AXIS, axis=axis, tiled=True), value
        )


def _all_reduce_leaf(op: ReduceOp, v: jax.Array, count: jax.Array | None) -> jax.Array:
    if op is ReduceOp.SUM:
        return jax.lax.psum(v, AXIS)
    if op is ReduceOp.MAX:
        return jax.lax.pmax(v, AXIS)
    if op is ReduceOp.MIN:
        return jax.lax.pmin(v, AXIS)
    if count is None:
        return jax.lax.pmean(v, AXIS)
    # MEAN: weighted by real samples; a replica holding only padding (weight 0) is left out,
    # so its value (often NaN, a mean over nothing) cannot leak in.
    w = count.astype(jnp.result_type(v, jnp.float32))
    total = jax.lax.psum(jnp.where(count > 0, v * w, jnp.zeros_like(v * w)), AXIS)
    return total / jax.lax.psum(w, AXIS)


_LOCAL = threading.local()


def get_replica_context() -> ReplicaContext | None:
    """The replica context of the innermost `strategy.run` being traced, else `None`.

    >>> import lockstep as ls
    >>> ls.get_replica_context() is None
    True
    """
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def replica_context(ctx: ReplicaContext) -> Iterator[ReplicaContext]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()
