"""Batch statistics over the whole global batch: masked, count-weighted across replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._replica_context import get_replica_context


def cross_replica_moments(x: Any, axes: int | Sequence[int], mask: Any = None, keepdims: bool = False,
                          across_replicas: bool = True) -> tuple[jax.Array, jax.Array]:
    """Mean and (biased) variance of `x` over `axes`, as one device computes them on the whole batch.

    Inside `strategy.run` (or a `Trainer` step), when `axes` includes the batch axis 0, the sums
    run over the real rows of *every* replica: padding rows (the replica context's mask) never
    count, and replicas weigh by their real rows (two small all-reduces: the mean, then the
    variance around it, as `jnp.var` does). Outside `run` it is the plain (masked) mean and
    variance. `BatchNormalization` layers of Keras models trained by a `Trainer` use it; it is
    the same tool for `FunctionalModel` authors.

    Args:
      x: the values, batch axis first.
      axes: the axes to reduce.
      mask: optional weights (0 or 1) shaped like `x`, or like `x` without its last axis (Keras'
        sequence masks).
      keepdims: keep the reduced axes with size 1.
      across_replicas: `False` gives this replica's own statistics (still without padding rows).

    Returns:
      (mean, variance) in float32 (or `x`'s dtype, if wider).

    Raises:
      ValueError: inside `run`, `x` has another number of rows than the replica's batch.

    >>> import lockstep as ls, numpy as np
    >>> s = ls.MirroredStrategy(4)
    >>> x = np.arange(10.0).reshape(5, 2)
    >>> batch = next(iter(s.experimental_distribute_dataset([x])))            # 5 rows on 4 replicas
    >>> mean, var = s.run(lambda b: ls.cross_replica_moments(b, axes=0), args=(batch,))
    >>> np.asarray(mean).tolist(), np.asarray(var).tolist()                    # padding never counts
    ([4.0, 5.0], [8.0, 8.0])
    >>> [float(v) for v in ls.cross_replica_moments(x, axes=0)[1]] == x.var(axis=0).tolist()
    True
    """
    x = jnp.asarray(x)
    x = x.astype(jnp.result_type(x.dtype, jnp.float32))
    axes = tuple(a % x.ndim for a in ((axes,) if isinstance(axes, int) else axes))
    w = jnp.ones(x.shape, x.dtype)
    if mask is not None:
        m = jnp.asarray(mask, x.dtype)
        w = w * (m[..., None] if m.ndim == x.ndim - 1 else m)
    ctx = get_replica_context()
    across = ctx.axis_name if ctx is not None and 0 in axes and across_replicas else None  # psum over it
    if ctx is not None and 0 in axes and ctx.mask is not None:
        rows = ctx.mask
        if x.shape[0] != rows.shape[0]:
            raise ValueError(f"`x` has {x.shape[0]} rows, but this replica's batch has {rows.shape[0]}: the batch "
                             "axis must come first for statistics over the global batch.")
        w = w * rows.reshape(rows.shape + (1,) * (x.ndim - 1)).astype(x.dtype)
    count = jnp.sum(w, axes, keepdims=True)
    total = jnp.sum(w * x, axes, keepdims=True)
    if across is not None:
        count, total = jax.lax.psum((count, total), across)
    count = jnp.maximum(count, jnp.finfo(x.dtype).tiny)
    mean = total / count
    squares = jnp.sum(w * jnp.square(x - mean), axes, keepdims=True)
    if across is not None:
        squares = jax.lax.psum(squares, across)
    var = squares / count
    if not keepdims:
        mean, var = jnp.squeeze(mean, axes), jnp.squeeze(var, axes)
    return mean, var
