"""Accuracy metrics, Keras' names and semantics: exact weighted means of per-sample matches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._base import same_rank
from ._reduction import MeanMetricWrapper


def _sparse_labels(y_true: jax.Array, y_pred: jax.Array) -> jax.Array:
    labels = jnp.asarray(y_true)
    if labels.ndim == y_pred.ndim and labels.shape[-1] == 1:
        labels = labels[..., 0]
    return labels.astype(jnp.int32)


def accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    y_true, y_pred = same_rank(y_true, y_pred)
    return (y_true == y_pred).astype(jnp.float32)


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5) -> jax.Array:
    y_true, y_pred = same_rank(y_true, y_pred)
    return (y_true == (y_pred > threshold).astype(y_true.dtype)).astype(jnp.float32)


def categorical_accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    return (jnp.argmax(y_true, -1) == jnp.argmax(y_pred, -1)).astype(jnp.float32)


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    y_pred = jnp.asarray(y_pred)
    return (_sparse_labels(y_true, y_pred) == jnp.argmax(y_pred, -1)).astype(jnp.float32)


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"`k` must be a positive integer, got k={k!r}.")
    return k


def _in_top_k(labels: jax.Array, y_pred: jax.Array, k: int) -> jax.Array:
    top = jax.lax.top_k(y_pred, min(k, y_pred.shape[-1]))[1]  # k above the classes: every class, as Keras
    return jnp.any(top == labels[..., None], axis=-1).astype(jnp.float32)


def top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> jax.Array:
    return _in_top_k(jnp.argmax(y_true, -1), jnp.asarray(y_pred), k)


def sparse_top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> jax.Array:
    y_pred = jnp.asarray(y_pred)
    return _in_top_k(_sparse_labels(y_true, y_pred), y_pred, k)


class Accuracy(MeanMetricWrapper):
    """How often `y_pred` equals `y_true`.

    >>> import lockstep as ls
    >>> m = ls.metrics.Accuracy(); m.update_state([1, 2, 3, 4], [0, 2, 3, 4]); float(m.result())
    0.75
    """

    direction = "up"

    def __init__(self, name: str = "accuracy", dtype: Any = "float32"):
        super().__init__(accuracy, name=name, dtype=dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often `y_pred > threshold` matches binary `y_true`."""

    direction = "up"

    def __init__(self, name: str = "binary_accuracy", dtype: Any = "float32", threshold: float = 0.5):
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=threshold)
        self.threshold = threshold


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max of `y_pred` matches the arg-max of one-hot `y_true`."""

    direction = "up"

    def __init__(self, name: str = "categorical_accuracy", dtype: Any = "float32"):
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max of `y_pred` matches integer `y_true`.

    >>> import lockstep as ls
    >>> m = ls.metrics.SparseCategoricalAccuracy()
    >>> m.update_state([2, 1], [[0.1, 0.6, 0.3], [0.05, 0.95, 0.0]]); float(m.result())
    0.5
    """

    direction = "up"

    def __init__(self, name: str = "sparse_categorical_accuracy", dtype: Any = "float32"):
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often one-hot `y_true`'s class is among the `k` largest predictions."""

    direction = "up"

    def __init__(self, k: int = 5, name: str = "top_k_categorical_accuracy", dtype: Any = "float32"):
        super().__init__(top_k_categorical_accuracy, name=name, dtype=dtype, k=_check_k(k))
        self.k = k


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often integer `y_true` is among the `k` largest predictions."""

    direction = "up"

    def __init__(self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy", dtype: Any = "float32"):
        super().__init__(sparse_top_k_categorical_accuracy, name=name, dtype=dtype, k=_check_k(k))
        self.k = k
