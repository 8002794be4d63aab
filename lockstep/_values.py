"""Distributed values (`PerReplica`, `Mirrored`, `DistributedBatch`) and the replica context.

These wrappers exist only at the `tf.distribute`-style boundary (`strategy.run`, `reduce`,
`gather`, distributed datasets). Inside lockstep, compiled steps take and return plain global
arrays; `unwrap` is the one way from a wrapper to its array.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from ._cross_replica import AXIS, all_gather, all_reduce, varies
from ._layout import StepInfo
from ._reduce import ReduceOp

if TYPE_CHECKING:
    from ._strategy import Strategy


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
    """A value identical on every replica by construction (say, the result of an all-reduce).

    It is used as its array: operators, `float`, indexing and NumPy work on it as is; `jnp`
    functions take `jnp.asarray(m)`.

    >>> import lockstep as ls, numpy as np, jax.numpy as jnp
    >>> s = ls.MirroredStrategy(2)
    >>> ctx = ls.get_replica_context
    >>> m = s.run(lambda: ctx().all_reduce("SUM", jnp.ones(3) * (ctx().replica_id_in_sync_group + 1)))
    >>> float((m * 2 + 1)[0]), float(np.sum(m)), float(jnp.sum(jnp.asarray(m))), m.shape
    (7.0, 9.0, 9.0, (3,))
    """

    __slots__ = ("_array", "_strategy")

    def __init__(self, array: jax.Array, strategy: "Strategy"):
        self._array = array
        self._strategy = strategy

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """The value once per local replica, as in `tf.distribute`."""
        return self._strategy.experimental_local_results(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy as np

        out = np.asarray(self._array)
        return out.astype(dtype) if dtype is not None else out

    def __jax_array__(self) -> jax.Array:
        """The value as a JAX array (`jnp.asarray(m)`; JAX 0.10 no longer lets other `jnp` functions
        call this by themselves: convert first, or use the operators and NumPy, which work as is)."""
        return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> Any:
        return self._array.dtype

    def __float__(self) -> float:
        return float(self._array)

    def __int__(self) -> int:
        return int(self._array)

    def __getitem__(self, i: Any) -> jax.Array:
        return self._array[i]

    def __repr__(self) -> str:
        return f"Mirrored({self._array!r})"


def _operator(name: str) -> Any:
    def op(self: Mirrored, *others: Any) -> Any:
        return getattr(self._array, name)(*(o._array if isinstance(o, Mirrored) else o for o in others))
    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__neg__", "__abs__", "__lt__",
              "__le__", "__gt__", "__ge__"):
    setattr(Mirrored, _name, _operator(_name))  # a Mirrored is used as its array, as TF's mirrored values are


class DistributedBatch:
    """One global batch split across replicas, padded to equal shapes, with a per-sample mask.

    Inside `strategy.run` the function receives `data`'s structure with each replica's rows
    (padding included); the mask is on `get_replica_context().mask`.

    Args:
      leaves: the padded global arrays, split over replicas.
      treedef: the structure the dataset yielded.
      mask: (padded rows,) float32, 1.0 for real rows, split like the leaves.
      step: the host-side layout of the batch.
      strategy: the strategy whose devices hold it.
      count: the step's real sample count, a replicated float32 scalar (losses divide by it).
    """

    __slots__ = ("_leaves", "_treedef", "_mask", "_count", "_step", "_strategy", "origin", "digest")

    def __init__(self, leaves: list[jax.Array], treedef: Any, mask: jax.Array, step: StepInfo,
                 strategy: "Strategy", count: jax.Array, origin: "DistributedBatch | None" = None):
        self.origin = origin or self  # the whole batch that parts unpacked from it share
        #: this worker's part of the batch's `rows_digest` (a callable: computed only when asked)
        self.digest: Any = None
        self._leaves = leaves
        self._treedef = treedef
        self._mask = mask
        self._step = step
        self._strategy = strategy
        self._count = count

    @property
    def data(self) -> Any:
        """The padded global batch, in the structure the dataset yielded."""
        return jax.tree.unflatten(self._treedef, self._leaves)

    @property
    def mask(self) -> jax.Array:
        """Per-sample mask of the padded global batch: 1.0 for real rows, 0.0 for padding."""
        return self._mask

    @property
    def count(self) -> jax.Array:
        """The real number of samples, a replicated float32 scalar."""
        return self._count

    @property
    def step(self) -> StepInfo:
        """The batch's layout: real rows per replica."""
        return self._step

    @property
    def num_real(self) -> int:
        """Number of real (not padding) samples in this global batch."""
        return self._step.num_real

    def __len__(self) -> int:
        data = self.data
        if not isinstance(data, (tuple, list)):
            raise TypeError(f"a DistributedBatch of a {type(data).__name__} has no parts to count or unpack.")
        return len(data)

    def __getitem__(self, i: int) -> "DistributedBatch":
        """Part `i` of a batch that is a tuple or list (``features, labels = batch``, as TF users
        unpack a distributed batch): the same rows, mask and step; several parts of one batch may
        go into one `run` together."""
        part = self.data[i] if isinstance(self.data, (tuple, list)) else None
        if part is None:
            raise TypeError(f"a DistributedBatch of a {type(self.data).__name__} cannot be indexed or unpacked.")
        leaves, treedef = jax.tree.flatten(part)
        return DistributedBatch(leaves, treedef, self._mask, self._step, self._strategy, self._count, self.origin)

    def __iter__(self) -> Iterator["DistributedBatch"]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return (f"DistributedBatch(num_real={self.num_real}, padded={self._step.padded_size}, "
                f"replicas={self._step.num_replicas})")


def is_distributed(x: Any) -> bool:
    """Whether `x` is a `PerReplica`, `Mirrored` or `DistributedBatch`."""
    return isinstance(x, (PerReplica, Mirrored, DistributedBatch))


def strategy_of(v: PerReplica | Mirrored | DistributedBatch) -> "Strategy":
    """The strategy that made a distributed value."""
    return v._strategy


def step_of(v: PerReplica) -> StepInfo | None:
    """The layout of the batch a per-replica value was computed from (None if none)."""
    return v._step


def unwrap(tree: Any) -> Any:
    """`tree` with every `PerReplica` / `Mirrored` leaf replaced by its global array (a
    per-replica value's leading axis is the replica); a single value works too."""
    return jax.tree.map(lambda v: v._array if isinstance(v, (PerReplica, Mirrored)) else v, tree,
                        is_leaf=lambda v: isinstance(v, (PerReplica, Mirrored)))


class ReplicaContext:
    """What a function running inside `strategy.run` knows about its replica.

    Read it with `lockstep.get_replica_context()`; outside `run` that returns `None`.
    """

    def __init__(self, strategy: "Strategy", mask: jax.Array | None, global_count: jax.Array | None = None,
                 typed: bool = True):
        self._strategy = strategy
        self._mask = mask
        self._global_count = global_count
        self._typed = typed  # traced with replication typing: `varies` tells per-replica values apart

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

    def all_reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Combines `value` (a pytree) across replicas; every replica gets the result.

        `MEAN` weighs each replica by its number of real samples in the step (a replica that
        holds only padding is left out); `SUM`, `MAX` and `MIN` combine every replica.
        Note: gradients taken with respect to values that are the same on every replica
        (model parameters passed to `run`) already come back summed over replicas; summing them
        again (TF's ``experimental_aggregate_gradients=False`` pattern) would multiply them by R,
        so a `SUM` of a floating value that is already the same on every replica warns.
        """
        op = ReduceOp.from_value(op)
        count = None if self._mask is None else jnp.sum(self._mask)

        leaves, tree = jax.tree.flatten(value)
        leaves = [jnp.asarray(v) for v in leaves]
        if op is ReduceOp.SUM and self._typed and any(
                not varies(v) and jnp.issubdtype(v.dtype, jnp.floating) for v in leaves):
            warnings.warn(
                "`all_reduce('SUM', ...)` got a value that is already the same on every replica, so the sum "
                f"is {self.num_replicas_in_sync} times it. Gradients of parameters passed to `run` come back "
                "already summed over replicas in lockstep (TF sums them in `apply_gradients` or with this "
                "all-reduce): use the gradients as they are, without the all-reduce.", UserWarning, stacklevel=2)
        return jax.tree.unflatten(tree, [all_reduce(op, v, count) for v in leaves])

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates every replica's `value` along `axis` (padding rows included, shapes being static)."""
        return jax.tree.map(lambda v: all_gather(jnp.asarray(v), axis), value)


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
    """Makes `ctx` the one `get_replica_context()` returns while a replica's function is traced."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()
