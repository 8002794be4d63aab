"""Per-example losses and `compute_average_loss`.

Every loss here returns one value per sample (shape ``(batch,)``); `compute_average_loss`
turns those into the step's loss so that a step on several replicas, with a short or
padded batch, equals the single-device step on the real samples.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._keras_kind import is_keras
from .engine import along_rows, get_replica_context, to_varying

EPSILON = 1e-7  # Keras' backend epsilon, used to clip probabilities


def _per_sample(x: jax.Array) -> jax.Array:
    return x if x.ndim <= 1 else jnp.mean(x.reshape(x.shape[0], -1), axis=-1)


def sparse_categorical_crossentropy(y_true: Any, y_pred: Any, from_logits: bool = False) -> jax.Array:
    """Cross-entropy between integer labels and class probabilities (or logits).

    >>> import lockstep as ls, numpy as np
    >>> ls.losses.sparse_categorical_crossentropy(np.array([1]), np.array([[0.5, 0.5]])).round(4)
    Array([0.6931], dtype=float32)
    """
    y_pred = jnp.asarray(y_pred)
    labels = jnp.asarray(y_true).astype(jnp.int32)
    if labels.ndim == y_pred.ndim:
        labels = labels.reshape(labels.shape[:-1])
    if from_logits:
        logp = jax.nn.log_softmax(y_pred, axis=-1)
    else:
        p = y_pred / jnp.sum(y_pred, axis=-1, keepdims=True)
        logp = jnp.log(jnp.clip(p, EPSILON, 1.0 - EPSILON))
    return _per_sample(-jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0])


def categorical_crossentropy(y_true: Any, y_pred: Any, from_logits: bool = False) -> jax.Array:
    """Cross-entropy between one-hot (or soft) labels and class probabilities (or logits)."""
    y_pred = jnp.asarray(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype)
    if from_logits:
        logp = jax.nn.log_softmax(y_pred, axis=-1)
    else:
        p = y_pred / jnp.sum(y_pred, axis=-1, keepdims=True)
        logp = jnp.log(jnp.clip(p, EPSILON, 1.0 - EPSILON))
    return _per_sample(-jnp.sum(y_true * logp, axis=-1))


def binary_crossentropy(y_true: Any, y_pred: Any, from_logits: bool = False) -> jax.Array:
    """Binary cross-entropy, averaged over the last axis as Keras does."""
    y_pred = jnp.asarray(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype).reshape(y_pred.shape)
    if from_logits:
        per = jnp.maximum(y_pred, 0) - y_pred * y_true + jnp.log1p(jnp.exp(-jnp.abs(y_pred)))
    else:
        p = jnp.clip(y_pred, EPSILON, 1.0 - EPSILON)
        per = -(y_true * jnp.log(p) + (1 - y_true) * jnp.log(1 - p))
    return _per_sample(per if per.ndim <= 1 else jnp.mean(per, axis=-1))


def mean_squared_error(y_true: Any, y_pred: Any) -> jax.Array:
    """Squared error, averaged over all but the first axis."""
    y_pred = jnp.asarray(y_pred)
    return _per_sample(jnp.square(jnp.asarray(y_true, y_pred.dtype).reshape(y_pred.shape) - y_pred))


def mean_absolute_error(y_true: Any, y_pred: Any) -> jax.Array:
    """Absolute error, averaged over all but the first axis."""
    y_pred = jnp.asarray(y_pred)
    return _per_sample(jnp.abs(jnp.asarray(y_true, y_pred.dtype).reshape(y_pred.shape) - y_pred))


_LOSSES: dict[str, Callable[..., jax.Array]] = {
    "sparse_categorical_crossentropy": sparse_categorical_crossentropy,
    "categorical_crossentropy": categorical_crossentropy,
    "binary_crossentropy": binary_crossentropy,
    "mean_squared_error": mean_squared_error,
    "mse": mean_squared_error,
    "mean_absolute_error": mean_absolute_error,
    "mae": mean_absolute_error,
}


def get(identifier: str | Callable[..., jax.Array]) -> Callable[[Any, Any], jax.Array]:
    """The per-example loss named by `identifier` (Keras names; a ``_from_logits`` suffix
    selects the logits variant), a `keras.losses.Loss` object's per-sample loss, or
    `identifier` itself if callable.

    Raises:
      ValueError: the name is unknown (the message lists the known names).
    """
    if is_keras(identifier) and hasattr(identifier, "call") and hasattr(
            identifier, "reduction"):
        return _keras_loss(identifier)
    if callable(identifier):
        return identifier
    if isinstance(identifier, str):
        name = identifier.lower()
        logits = name.endswith("_from_logits")
        base = name.removesuffix("_from_logits")
        fn = _LOSSES.get(base)
        if fn is not None and (not logits or "crossentropy" in base):
            return (lambda t, p: fn(t, p, from_logits=True)) if logits else fn
        keras = sys.modules.get("keras")
        if keras is not None and not logits:  # another Keras loss name: Keras' per-sample function
            try:
                return keras.losses.get(identifier)
            except ValueError:
                pass
    known = sorted(_LOSSES) + [k + "_from_logits" for k in sorted(_LOSSES) if "crossentropy" in k]
    raise ValueError(f"`loss` must be a callable or one of {known}, got loss={identifier!r}.")


def _keras_loss(loss: Any) -> Callable[..., jax.Array]:
    """A `keras.losses.Loss` object as a per-sample loss (``(y_true, y_pred, sample_weight=None)``),
    reduced as Keras' ``"sum_over_batch_size"`` reduces it once the Trainer takes the mean over the
    step's real samples: its `call`'s weighted values averaged over their other axes (Keras divides
    by every element, a time step's or a pixel's too); with a Keras mask (the outputs', as
    ``Embedding(mask_zero=True)`` gives it, or the loss's own: ``ignore_class``), summed over the
    unmasked elements and scaled by the step's real samples over its unmasked elements, as Keras'
    `apply_mask` weighs a batch's (`_masked_per_sample`)."""
    if loss.reduction not in ("sum_over_batch_size", "auto", None):
        raise ValueError(
            f"`loss` is a Keras {type(loss).__name__} with reduction={loss.reduction!r}: lockstep takes the mean over "
            "the step's real samples (Keras' 'sum_over_batch_size'); build the loss with that reduction.")
    def per_sample(y_true: Any, y_pred: Any, sample_weight: Any = None) -> jax.Array:
        in_mask = keras_mask(y_pred)  # (before the cast below, which makes new arrays)
        if getattr(loss, "dtype", None) is not None:  # as Keras' Loss.__call__: both in the loss's dtype (float32)
            y_true, y_pred = (jax.tree.map(lambda a: jnp.asarray(a, loss.dtype), t) for t in (y_true, y_pred))
        values = loss.call(y_true, y_pred)
        out_mask = keras_mask(values)
        mask = in_mask & out_mask if in_mask is not None and out_mask is not None else (
            in_mask if in_mask is not None else out_mask)
        values = times_sample_weight(jnp.asarray(values), sample_weight)
        return _per_sample(values) if mask is None else _masked_per_sample(values, mask)
    per_sample.name = loss.name  # type: ignore[attr-defined]  # what label checks key on
    per_sample.ignore_class = (getattr(loss, "_fn_kwargs", None) or {}).get("ignore_class")  # type: ignore[attr-defined]
    per_sample.takes_sample_weight = True  # type: ignore[attr-defined]
    return per_sample


def keras_mask(x: Any) -> Any:
    """The Keras mask `x` carries (a model's output after ``Embedding(mask_zero=True)`` or
    ``Masking``, which Keras' losses and metrics leave masked elements out by); None without one,
    or without Keras.

    >>> keras_mask(jnp.ones(3)) is None
    True
    """
    if "keras" not in sys.modules:
        return None
    from keras.src.backend import get_keras_mask

    return get_keras_mask(x)


def weighted_per_sample(loss_fn: Callable[..., Any], y_true: Any, y_pred: Any, sample_weight: Any,
                        where: str = "the model's output", dtype: Any = None) -> jax.Array:
    """`loss_fn`'s per-sample losses times `sample_weight`: a Keras loss object (`takes_sample_weight`)
    weighs its own elements; a loss given by name (its losses first cast to `dtype`, where given) is
    refused on an output (`where`) carrying a Keras mask, whose masked elements it would count.

    >>> weighted_per_sample(mean_squared_error, jnp.zeros((2, 1)), jnp.ones((2, 1)), [0.5, 2.0]).tolist()
    [0.5, 2.0]
    """
    if getattr(loss_fn, "takes_sample_weight", False):
        return loss_fn(y_true, y_pred, sample_weight)
    if keras_mask(y_pred) is not None:
        raise ValueError(
            f"{where} carries a Keras mask (Embedding(mask_zero=True) or Masking, kept to the output), which Keras' "
            f"loss leaves masked elements out by, but the loss {getattr(loss_fn, '__name__', loss_fn)!r} is given by "
            "name and lockstep's reduces every element: compile with the Keras loss object instead (say, "
            "keras.losses.SparseCategoricalCrossentropy()), which lockstep reduces with the mask as Keras does.")
    values = loss_fn(y_true, y_pred)
    return times_sample_weight(values if dtype is None else jnp.asarray(values, dtype), sample_weight)


def _masked_per_sample(values: jax.Array, mask: Any) -> jax.Array:
    """Each row's unmasked (weighted) losses, summed and scaled so that their mean over the step's
    real rows is their sum over the step's unmasked elements (inside `run`: every replica's real
    rows; 0 where none is unmasked), Keras' loss of a batch with a mask.

    >>> [round(v, 4) for v in _masked_per_sample(jnp.array([[1.0, 3.0], [5.0, 7.0]]),
    ...                                          jnp.array([[True, False], [True, True]])).tolist()]
    [0.6667, 8.0]
    """
    m = jnp.asarray(mask, values.dtype)
    if m.ndim > values.ndim or m.shape != values.shape[:m.ndim]:
        raise ValueError(f"the Keras mask of shape {m.shape} does not fit the loss's values of shape {values.shape}.")
    m = m.reshape(m.shape + (1,) * (values.ndim - m.ndim))
    n = values.shape[0]
    ctx = get_replica_context()
    counted = jnp.broadcast_to(m, values.shape).astype(jnp.float32)  # counts in float32 (bfloat16 stops at 256)
    rows, unmasked = jnp.asarray(n, jnp.float32), jnp.sum(counted)
    if ctx is not None and ctx.mask is not None:  # padding rows left out; the step's rows and unmasked elements
        rows = jnp.asarray(ctx.global_count(), jnp.float32)
        unmasked = ctx.all_reduce("SUM", jnp.sum(counted * along_rows(ctx.mask.astype(jnp.float32), m.ndim)))
    scale = jnp.where(unmasked > 0, rows / jnp.where(unmasked > 0, unmasked, 1), 0)
    return (jnp.sum((values * m).reshape(n, -1), axis=1) * scale).astype(values.dtype)


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None,
                         global_batch_size: int | None = None) -> jax.Array:
    """The step's loss from per-sample losses: sum over real samples / global real sample count.

    Inside `strategy.run` it returns this replica's share: its masked sum divided by the real
    number of samples of the whole step (all replicas), so the sum over replicas is the mean
    loss and gradients (which JAX sums over replicas for you) are the single-device ones.
    Outside `run` it is the plain (weighted) sum divided by the batch size. Inside `run` without
    a distributed batch (arrays passed straight to `run`, so every replica holds the same
    rows), each replica's share is its sum divided by R times its rows, as in TF: summed over
    replicas it is the mean, and the gradient of the parameters is the whole batch's.

    Args:
      per_example_loss: per-sample losses, shape ``(batch,)`` (other axes are summed).
      sample_weight: optional weights, broadcastable to `per_example_loss`.
      global_batch_size: divide by this instead of the real sample count (as in TF).

    >>> import lockstep as ls, numpy as np
    >>> float(ls.compute_average_loss(np.array([1.0, 2.0, 3.0])))
    2.0
    """
    ctx = get_replica_context()
    if ctx is None:
        loss = _weighted_loss(per_example_loss, sample_weight, global_batch_size)
        denom = loss.shape[0] if global_batch_size is None else global_batch_size
        return jnp.sum(loss) / denom
    if ctx.mask is None:  # a replica without a distributed batch: every row is real
        # Each replica's share is its own value even when every replica got the same arrays
        # (TF's semantics): typed per replica, the gradient of the replicated parameters is
        # summed over replicas, so it is the whole batch's gradient, as TF's is after its
        # all-reduce (not 1/R of it).
        loss = to_varying(_weighted_loss(per_example_loss, sample_weight, global_batch_size), ctx.axis_name)
        count = jnp.asarray(loss.shape[0] * ctx.num_replicas_in_sync, loss.dtype)
        return masked_average_loss(loss, jnp.ones(loss.shape[:1], loss.dtype), count, None, global_batch_size)
    return masked_average_loss(per_example_loss, ctx.mask, ctx.global_count(), sample_weight, global_batch_size)


def scale_regularization_loss(regularization_loss: Any) -> jax.Array:
    """A regularization loss (a value or a list of them, summed) as this replica's share: divided
    by the number of replicas, as TF's `tf.nn.scale_regularization_loss`, so that added to
    `compute_average_loss` inside `strategy.run` it counts once in the step's gradient (JAX sums
    the gradients of the replicated parameters over the replicas). Outside `run` it is the sum.

    >>> import lockstep as ls, numpy as np, jax.numpy as jnp
    >>> s = ls.MirroredStrategy(4)
    >>> float(s.reduce("SUM", s.run(lambda: ls.scale_regularization_loss([jnp.float32(1.0), jnp.float32(2.0)]))))
    3.0
    """
    total = sum(jnp.sum(jnp.asarray(r)) for r in regularization_loss) if isinstance(
        regularization_loss, (list, tuple)) else jnp.sum(jnp.asarray(regularization_loss))
    ctx = get_replica_context()
    return total / (1 if ctx is None else ctx.num_replicas_in_sync)


def _weighted_loss(per_example_loss: Any, sample_weight: Any, global_batch_size: Any) -> jax.Array:
    loss = jnp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise ValueError(f"`per_example_loss` must have a batch axis, got a scalar of shape {loss.shape}.")
    if global_batch_size is not None and (isinstance(global_batch_size, bool) or global_batch_size <= 0):
        raise ValueError(f"`global_batch_size` must be a positive integer, got {global_batch_size!r}.")
    return times_sample_weight(loss, sample_weight)


def times_sample_weight(per_example_loss: jax.Array, sample_weight: Any) -> jax.Array:
    """Per-sample losses times their weights (one per sample, or per leading axes such as time steps).

    A weight of shape ``(N, 1)`` weighs losses of shape ``(N,)`` row by row, as Keras squeezes it.

    >>> times_sample_weight(jnp.ones((2, 3)), [0.5, 2.0]).tolist()
    [[0.5, 0.5, 0.5], [2.0, 2.0, 2.0]]
    >>> times_sample_weight(jnp.array([1.0, 3.0]), [[0.5], [2.0]]).tolist()
    [0.5, 6.0]
    """
    if sample_weight is None:
        return per_example_loss
    w = jnp.asarray(sample_weight, per_example_loss.dtype)
    while w.ndim > per_example_loss.ndim and w.shape[-1] == 1:  # (it broadcast to an (N, N) grid)
        w = w[..., 0]
    if w.ndim > per_example_loss.ndim:
        raise ValueError(
            f"`sample_weight` of shape {w.shape} has more axes than the losses it weighs, of shape "
            f"{per_example_loss.shape} (a loss given by name is one value per sample): give one weight per sample, "
            "or a Keras loss object, whose per-element values a weight per time step weighs.")
    return per_example_loss * along_rows(w, per_example_loss.ndim)


def masked_average_loss(per_example_loss: Any, mask: jax.Array, count: jax.Array, sample_weight: Any = None,
                        global_batch_size: int | None = None) -> jax.Array:
    """One replica's share of the step's loss: the sum of its real rows' (weighted) losses divided
    by the step's real sample `count` over all replicas (or by `global_batch_size`).

    The core of `compute_average_loss`, with the mask and count given explicitly (the `Trainer`'s
    compiled steps pass them); summed over replicas it is the mean loss of the real samples.

    >>> import lockstep as ls, numpy as np
    >>> float(ls.losses.masked_average_loss(np.array([1.0, 2.0, 9.0]), np.array([1.0, 1.0, 0.0]), 4.0))
    0.75
    """
    loss = _weighted_loss(per_example_loss, sample_weight, global_batch_size)
    mask = jnp.asarray(mask)
    if mask.shape[0] != loss.shape[0]:
        raise ValueError(
            f"`per_example_loss` has {loss.shape[0]} rows but this replica's batch has "
            f"{mask.shape[0]}; pass one loss per sample of the distributed batch."
        )
    m = mask.reshape(mask.shape + (1,) * (loss.ndim - 1)) > 0
    loss = jnp.where(m, loss, jnp.zeros_like(loss))
    denom = jnp.asarray(count if global_batch_size is None else global_batch_size, loss.dtype)
    return jnp.sum(loss) / denom
