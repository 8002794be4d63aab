"""The replica context: what a function running on one replica of a compiled step knows (its
index, the step's mask and real-sample count, collectives over the batch axis), and the stack
that `get_replica_context()` reads while a replica's function is traced.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from ._cross_replica import all_gather, all_reduce, varies
from ._reduce_op import ReduceOp


class ReplicaContext:
    """What a function running inside `strategy.run` knows about its replica.

    Read it with `lockstep.get_replica_context()`; outside `run` that returns `None`.
    """

    def __init__(self, num_replicas: int, mask: jax.Array | None, global_count: jax.Array | None = None,
                 typed: bool = True, strategy: Any = None, *, axis_name: str | tuple[str, ...]):
        self._num_replicas = num_replicas
        self._axis_name = axis_name
        self._strategy = strategy  # what `run` was called on, handed back as `.strategy` (tf.distribute's API)
        self._mask = mask
        self._global_count = global_count
        self._typed = typed  # traced with replication typing: `varies` tells per-replica values apart

    def with_batch(self, mask: jax.Array, global_count: jax.Array) -> "ReplicaContext":
        """This context for another batch (its mask and real count): a compiled function that runs
        several steps enters it around each step, so layers read that step's mask."""
        return ReplicaContext(self._num_replicas, mask, global_count, self._typed, self._strategy,
                              axis_name=self._axis_name)

    @property
    def strategy(self) -> Any:
        """The strategy whose `run` traces this replica's function."""
        return self._strategy

    @property
    def axis_name(self) -> str | tuple[str, ...]:
        """The mesh axis along which the replicas lie (the engine's batch axis): the axis name for
        `jax.lax` collectives over replicas inside `run`.

        >>> import jax, lockstep as ls, numpy as np
        >>> count = ls.MirroredStrategy(2).run(lambda: jax.lax.psum(1.0, ls.get_replica_context().axis_name))
        >>> float(np.asarray(count))
        2.0
        """
        return self._axis_name

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        """This replica's index, 0 .. num_replicas_in_sync - 1 (a traced integer)."""
        return jax.lax.axis_index(self._axis_name)

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
        return jax.lax.psum(jnp.sum(self._mask), self._axis_name)

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
                not varies(v, self._axis_name) and jnp.issubdtype(v.dtype, jnp.floating) for v in leaves):
            warnings.warn(
                "`all_reduce('SUM', ...)` got a value that is already the same on every replica, so the sum "
                f"is {self.num_replicas_in_sync} times it. Gradients of parameters passed to `run` come back "
                "already summed over replicas in lockstep (TF sums them in `apply_gradients` or with this "
                "all-reduce): use the gradients as they are, without the all-reduce.", UserWarning, stacklevel=2)
        return jax.tree.unflatten(tree, [all_reduce(op, v, count, self._axis_name) for v in leaves])

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates every replica's `value` along `axis` (padding rows included, shapes being static)."""
        return jax.tree.map(lambda v: all_gather(jnp.asarray(v), axis, self._axis_name), value)


_LOCAL = threading.local()


def get_replica_context() -> ReplicaContext | None:
    """The replica context of the innermost `strategy.run` being traced, else `None`.

    >>> import lockstep as ls
    >>> ls.get_replica_context() is None
    True
    """
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def replicas_axis() -> str | tuple[str, ...]:
    """The mesh axis along which the replicas of the step being traced lie (its replica context's).

    Raises:
      RuntimeError: called outside a replica's function being traced.
    """
    ctx = get_replica_context()
    if ctx is None:
        raise RuntimeError("lockstep's steps are traced inside the engine's replica context.")
    return ctx.axis_name


@contextlib.contextmanager
def replica_context(ctx: ReplicaContext | None) -> Iterator[ReplicaContext | None]:
    """Makes `ctx` the one `get_replica_context()` returns while a replica's function is traced
    (None: code traced there as if outside any replica)."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()
