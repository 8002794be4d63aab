"""Distributed values (`PerReplica`, `Mirrored`; the engine's `DistributedBatch` is the third).

These wrappers exist only at the `tf.distribute`-style boundary (`strategy.run`, `reduce`,
`gather`, distributed datasets). Inside lockstep, compiled steps take and return plain global
arrays; `unwrap` is the one way from a wrapper to its array. A value holds the engine that made
it (a strategy's ``extended``), never the strategy.
"""

from __future__ import annotations

from typing import Any

import jax

from ..engine import DistributedBatch, Engine, StepInfo


class PerReplica:
    """One value per replica, held as a global array whose leading axis is the replica.

    Returned by `strategy.run` for outputs that differ between replicas. Pass it back into
    `run` (each replica gets its own entry), or read it with `strategy.reduce`,
    `strategy.gather` or `strategy.experimental_local_results`.
    """

    __slots__ = ("_array", "engine", "_step")

    def __init__(self, array: jax.Array, engine: Engine, step: StepInfo | None = None):
        self._array = array
        self.engine = engine
        self._step = step

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """This process's replicas' values, in replica order."""
        return self.engine.local_entries(self._array)

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

    __slots__ = ("_array", "engine")

    def __init__(self, array: jax.Array, engine: Engine):
        self._array = array
        self.engine = engine

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """The value once per local replica, as in `tf.distribute`."""
        return (self._array,) * self.engine.num_local_replicas

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


def is_distributed(x: Any) -> bool:
    """Whether `x` is a `PerReplica`, `Mirrored` or `DistributedBatch`."""
    return isinstance(x, (PerReplica, Mirrored, DistributedBatch))


def engine_of(v: PerReplica | Mirrored | DistributedBatch) -> Engine:
    """The engine (a strategy's ``extended``) that made a distributed value."""
    return v.engine


def step_of(v: PerReplica) -> StepInfo | None:
    """The layout of the batch a per-replica value was computed from (None if none)."""
    return v._step


def unwrap(tree: Any) -> Any:
    """`tree` with every `PerReplica` / `Mirrored` leaf replaced by its global array (a
    per-replica value's leading axis is the replica); a single value works too."""
    return jax.tree.map(lambda v: v._array if isinstance(v, (PerReplica, Mirrored)) else v, tree,
                        is_leaf=lambda v: isinstance(v, (PerReplica, Mirrored)))


