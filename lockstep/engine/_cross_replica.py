"""Cross-replica reductions: collectives inside a replica, and reductions of per-replica arrays.

Inside `strategy.run` (a `shard_map` over the mesh) values are combined with `all_reduce` over
the named axis that holds the replicas (the engine's batch axis); outside, a per-replica value is
a global array whose leading axis is the replica (shape ``(R, ...)``), reduced by `reduce_stacked` / `gather_stacked` in one compiled program
whose result is replicated on every device (so every worker can read it). `MEAN` is weighted by
real samples, so replicas that hold only padding never leak into a result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._batch_rows import StepInfo, rows_digest
from ._reduce_op import ReduceOp

# --- inside a replica ----------------------------------------------------------------------
def axis_names(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes of a collective's `axis_name` (one name, or a tuple of them: replicas laid
    along several axes, as in hybrid sharding)."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def varies(x: Any, axis_name: str | tuple[str, ...]) -> bool:
    """Whether a traced value inside `shard_map` may differ along the mesh axis `axis_name` (along
    any of them, for a tuple: it is the same on every replica only where it varies along none)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    varying = mat.varying if mat is not None else getattr(aval, "vma", None)  # (older JAX spelling)
    return True if varying is None else any(a in varying for a in axis_names(axis_name))


def to_varying(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """`x` typed as differing along `axis_name` (a no-op where it already does)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    varying = mat.varying if mat is not None else getattr(aval, "vma", None)
    missing = tuple(a for a in axis_names(axis_name) if varying is not None and a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def lowest(dtype: Any) -> Any:
    """The identity of `max` for `dtype`."""
    dtype = jnp.dtype(dtype)
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def highest(dtype: Any) -> Any:
    """The identity of `min` for `dtype`."""
    dtype = jnp.dtype(dtype)
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


def all_reduce(op: ReduceOp, v: jax.Array, count: jax.Array | None, axis_name: str) -> jax.Array:
    """`v` combined over the replicas along `axis_name`; `MEAN` weighs each replica by its
    real-sample `count` (a replica holding only padding, weight 0, is left out so its NaN cannot
    leak in)."""
    if op is ReduceOp.SUM:
        return jax.lax.psum(v, axis_name)
    if op is ReduceOp.MAX:
        return jax.lax.pmax(v, axis_name)
    if op is ReduceOp.MIN:
        return jax.lax.pmin(v, axis_name)
    if count is None:
        return jax.lax.pmean(v, axis_name)
    w = count.astype(jnp.result_type(v, jnp.float32))
    total = jax.lax.psum(jnp.where(count > 0, v * w, jnp.zeros_like(v * w)), axis_name)
    return total / jax.lax.psum(w, axis_name)


def all_gather(v: jax.Array, axis: int, axis_name: str) -> jax.Array:
    """Every replica's `v` (the replicas along the mesh axis `axis_name`) concatenated along `axis`."""
    return jax.lax.all_gather(to_varying(v, axis_name), axis_name, axis=axis, tiled=True)


# --- outside: per-replica arrays of shape (R, ...) ------------------------------------------------
class ReplicatedCall:
    """Compiles helper programs whose results are replicated on every device of `mesh`."""

    def __init__(self, mesh: Mesh):
        self._replicated = NamedSharding(mesh, P())
        self._jitted: dict[Any, Callable[..., Any]] = {}

    def __call__(self, fn: Callable[..., Any], *args: Any, **static: Any) -> Any:
        key = (fn, tuple(sorted(static)))
        jitted = self._jitted.get(key)
        if jitted is None:
            jitted = self._jitted[key] = jax.jit(fn, static_argnames=tuple(static), out_shardings=self._replicated)
        return jitted(*args, **static)


def reduce_stacked(call: ReplicatedCall, op: ReduceOp, stacked: jax.Array, step: StepInfo | None,
                   axis: int | None) -> jax.Array:
    """A per-replica value `stacked` (R, ...) reduced across replicas (and rows, with `axis=0`)."""
    r = stacked.shape[0]
    if axis == 0 and stacked.ndim < 2:
        raise ValueError("`axis=0` needs per-replica values with a batch axis, got scalars per replica.")
    if axis is None:
        weights = np.ones(r, np.float32) if step is None else step.counts.astype(np.float32)
        return call(_reduce_replicas, stacked, weights, op=op)
    rows = stacked.shape[1]
    row_mask = step.row_mask if step is not None and rows == step.per_replica else np.ones((r, rows), bool)
    return call(_reduce_rows, stacked, row_mask, op=op)


def reduce_replicated(op: ReduceOp, arr: jax.Array, num_replicas: int, axis: int | None) -> jax.Array:
    """A value that is the same on every replica, reduced as if each replica held it."""
    if axis == 0 and arr.ndim == 0:
        raise ValueError("`axis=0` needs values with a batch axis, got a scalar.")
    if op is ReduceOp.SUM:
        return arr.sum(0) * num_replicas if axis == 0 else arr * num_replicas
    if op is ReduceOp.MEAN:
        return arr.mean(0) if axis == 0 else arr
    return (arr.max(0) if op is ReduceOp.MAX else arr.min(0)) if axis == 0 else arr


def gather_stacked(call: ReplicatedCall, stacked: jax.Array, step: StepInfo | None, axis: int) -> jax.Array:
    """A per-replica value concatenated along `axis`; padding rows of batch-aligned values dropped."""
    if stacked.ndim < 2:
        raise ValueError("`gather` needs per-replica values with at least one axis, got scalars per replica.")
    if axis == 0 and step is not None and stacked.shape[1] == step.per_replica:
        return call(_take_rows, stacked, np.flatnonzero(step.row_mask.reshape(-1)))
    return call(_concat_replicas, stacked, axis=axis)


@functools.partial(jax.jit, static_argnums=1)
def split_rows(a: jax.Array, r: int) -> jax.Array:
    """A global batch array (R*b, ...) as per-replica rows (R, b, ...)."""
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
        return jnp.max(jnp.where(m, stacked, lowest(stacked.dtype)), axis=(0, 1))
    return jnp.min(jnp.where(m, stacked, highest(stacked.dtype)), axis=(0, 1))


def _take_rows(stacked: jax.Array, idx: jax.Array) -> jax.Array:
    flat = stacked.reshape(-1, *stacked.shape[2:])
    return jnp.take(flat, idx, axis=0)


def _concat_replicas(stacked: jax.Array, *, axis: int) -> jax.Array:
    return jnp.concatenate(list(stacked), axis=axis)


# --- across worker processes, on the host ---------------------------------------------------
def spread(x: Any) -> bool:
    """Whether `x` is a global array some of whose shards only other workers hold (not one every
    worker holds whole, as a multi-worker strategy's replicated weights)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated


def held(x: Any) -> Any:
    """`x` as this process keeps it: on the host, or, where other workers hold some of its shards,
    the global array as it lies (no worker reads the whole of it)."""
    return x if spread(x) else np.asarray(x)


def own_copies(tree: Any, pick: Callable[[Any], bool] | None = None) -> Any:
    """`tree` with each device array among its leaves copied (those `pick` chooses, called once
    a leaf, in order), laid out as it was (no collective: each worker copies its own shards);
    anything else as it is. The training program takes over (donates) the buffers of the state it
    is given; a copy is the caller's alone. The copies are one compiled program per mesh (or set
    of devices): one dispatch for a whole state, where a copy an array would take one each (596
    for a 12-block transformer and its Adam moments: 50 ms on a 2-core CPU, 2 ms in one program).

    >>> x = jax.numpy.arange(3)
    >>> y, n = own_copies([x, 1])
    >>> y is x, y.tolist(), n
    (False, [0, 1, 2], 1)
    """
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[Any, list[int]] = {}
    for i, a in enumerate(leaves):
        if (pick is None or pick(a)) and isinstance(a, jax.Array):
            s = a.sharding
            groups.setdefault(s.mesh if isinstance(s, NamedSharding) else frozenset(s.device_set), []).append(i)
    for places in groups.values():
        given = tuple(leaves[i] for i in places)
        # (out_shardings: each copy as its array lies, memory kind included, not as XLA would place it)
        copies = jax.jit(_copied, out_shardings=tuple(a.sharding for a in given))(given)
        for i, c in zip(places, copies):
            leaves[i] = c
    return jax.tree.unflatten(treedef, leaves)


def _copied(arrays: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(a.copy() for a in arrays)  # (JAX's copy primitive: a new buffer)


def unshared(arrays: Any) -> list[Any]:
    """The device arrays among `arrays` whose buffers no other live array holds (a Keras variable's
    own array placed again without a copy shares them): one that only its holder refers to may be
    taken over (donated) by a program without a copy.

    >>> x = jax.numpy.arange(3)
    >>> [a is x for a in unshared([x, 1])]
    [True]
    """
    if jax.process_count() > 1:  # (a global array's shards may not be readable one by one there): none
        return []
    arrays = [a for a in arrays if isinstance(a, jax.Array) and _buffers(a)]
    try:
        mine = {id(x) for a in arrays for x in (a, *(s.data for s in a.addressable_shards))}  # (its shards' own)
        others = {p for a in jax.live_arrays() if id(a) not in mine for p in _buffers(a)}
    except ValueError:  # an array whose shards cannot be read one by one: none said unshared
        return []
    return [a for a in arrays if not others.intersection(_buffers(a))]


def _buffers(a: jax.Array) -> list[int]:
    """Where `a`'s shards on this process lie; none for an array whose buffers were taken over."""
    try:
        return [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
    except RuntimeError:  # deleted, or sharing a buffer a program took over (JAX's errors are RuntimeErrors)
        return []


def host_value(x: Any) -> np.ndarray:
    """`x`'s whole value on this host: a collective among the workers for an array whose shards
    they hold apart (every worker must call it), a copy of a local shard for one each holds whole.

    >>> host_value(jax.numpy.arange(3)).tolist()
    [0, 1, 2]
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def broadcast_from_chief(value: Any) -> Any:
    """Worker 0's `value` (a pytree of arrays or scalars) on every worker."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(value)


def allgather_sizes(n: int) -> np.ndarray:
    """Every worker's `n`, in worker order (one small collective across workers)."""
    return allgather_ints([n])[:, 0]


def batch_digests(leaves: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """(every worker's checksum of the batch `leaves`, in worker order; the workers whose batch
    differs from worker 0's): one small collective, so every worker sees the same answer.

    >>> batch_digests([np.arange(4.0)])[1]  # one process
    []
    """
    digests = [int(d) for d in allgather_sizes(rows_digest(leaves, 0) if leaves else 0)]
    return digests, [w for w, d in enumerate(digests) if d != digests[0]]


def allgather_ints(values: list[int]) -> np.ndarray:
    """Every worker's `values` (as many on each; int32 unless JAX runs with x64), one row per worker
    in worker order (one small collective across workers).

    >>> allgather_ints([3, 4]).tolist()  # one process
    [[3, 4]]
    """
    if jax.process_count() == 1:
        return np.array([values], np.int64)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.array(values, np.int64))).reshape(-1, len(values))
