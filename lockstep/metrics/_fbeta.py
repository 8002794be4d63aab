"""`FBetaScore` and `F1Score`: per-class counts reduced across replicas, never per-replica scores."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._base import Metric, State, check_labels, divide_no_nan, expand_weight

_AVERAGES = (None, "micro", "macro", "weighted")


class FBetaScore(Metric):
    """F-beta score, with Keras' arguments; exact across replicas because counts are reduced.

    `y_true` is one-hot (as in Keras) or integer class labels; `y_pred` holds per-class scores.
    With `threshold=None` the arg-max class is the prediction; else every class whose score is
    above `threshold`. Classes that never occur score 0 (Keras; scikit-learn with
    ``labels=range(num_classes), zero_division=0``).

    Args:
      average: ``None`` (one score per class), ``"micro"``, ``"macro"`` or ``"weighted"``.
      beta: weight of recall against precision (> 0).
      threshold: a float in [0, 1], or None for arg-max.
      num_classes: number of classes; None to infer it from the first batch.

    >>> import lockstep as ls, numpy as np
    >>> m = ls.metrics.F1Score(average="macro")
    >>> m.update_state(np.array([0, 1, 2, 2]), np.eye(3)[[0, 2, 2, 1]])
    >>> round(float(m.result()), 4)
    0.5
    """

    direction = "up"

    def __init__(self, average: str | None = None, beta: float = 1.0, threshold: float | None = None,
                 name: str = "fbeta_score", dtype: Any = "float32", num_classes: int | None = None):
        if average not in _AVERAGES:
            raise ValueError(f"`average` must be one of {_AVERAGES}, got average={average!r}.")
        if not isinstance(beta, (int, float)) or beta <= 0:
            raise ValueError(f"`beta` must be a number > 0, got beta={beta!r}.")
        if threshold is not None and not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"`threshold` must lie in [0, 1] or be None, got threshold={threshold!r}.")
        if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 1):
            raise ValueError(f"`num_classes` must be a positive integer, got num_classes={num_classes!r}.")
        super().__init__(name=name, dtype=dtype)
        self.average, self.beta, self.threshold = average, float(beta), threshold
        self.num_classes = num_classes
        if num_classes is not None:
            self._declare(num_classes)

    def _declare(self, k: int) -> None:
        self.num_classes = k
        for field in ("true_positives", "false_positives", "false_negatives", "intermediate_weights"):
            self.add_state(field, shape=(k,))

    @property
    def built(self) -> bool:
        return bool(self._specs)

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        self._declare(int(y_pred_shape[-1]) if len(y_pred_shape) > 1 else 1)

    def check_inputs(self, *args: Any) -> None:
        y_true, y_pred = args[0], args[1]
        k = self.num_classes or (y_pred.shape[-1] if y_pred.ndim > 1 else 1)
        if self._sparse(y_true, y_pred):
            check_labels(y_true, k)

    @staticmethod
    def _sparse(y_true: jax.Array, y_pred: jax.Array) -> bool:
        return y_pred.ndim > 1 and y_pred.shape[-1] > 1 and (
            y_true.ndim == y_pred.ndim - 1 or (y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1))

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        y_pred = jnp.asarray(y_pred, jnp.float32)
        y_true = jnp.asarray(y_true)
        if y_pred.ndim == 1:
            y_pred = y_pred[:, None]
        if self._sparse(y_true, y_pred):
            labels = y_true.reshape(y_true.shape[0]).astype(jnp.int32)
            y_true = jax.nn.one_hot(labels, y_pred.shape[-1], dtype=jnp.float32)
        y_true = y_true.astype(jnp.float32).reshape(y_pred.shape)
        if y_pred.shape[-1] != self.num_classes:
            raise ValueError(f"`y_pred` must have {self.num_classes} classes (last axis), got shape {y_pred.shape}.")
        if self.threshold is None:
            top = jnp.max(y_pred, axis=-1, keepdims=True)
            pred = ((y_pred >= top) & (jnp.abs(y_pred) > 1e-9)).astype(jnp.float32)
        else:
            pred = (y_pred > self.threshold).astype(jnp.float32)
        w = expand_weight(sample_weight, y_true)
        wt = jnp.where(w != 0, w * y_true, 0.0)
        wf = jnp.where(w != 0, w * (1.0 - y_true), 0.0)
        return {"true_positives": jnp.sum(pred * wt, 0), "false_positives": jnp.sum(pred * wf, 0),
                "false_negatives": jnp.sum((1.0 - pred) * wt, 0), "intermediate_weights": jnp.sum(wt, 0)}

    def result_from(self, state: State) -> jax.Array:
        tp, fp, fn = state["true_positives"], state["false_positives"], state["false_negatives"]
        if self.average == "micro":
            tp, fp, fn = jnp.sum(tp), jnp.sum(fp), jnp.sum(fn)
        b2 = self.beta ** 2
        score = divide_no_nan((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp)
        if self.average == "weighted":
            support = state["intermediate_weights"]
            return divide_no_nan(jnp.sum(score * support), jnp.sum(support))
        if self.average == "macro":
            return jnp.mean(score)
        return score


class F1Score(FBetaScore):
    """F1 score (`FBetaScore` with beta = 1).

    >>> import lockstep as ls, numpy as np
    >>> m = ls.metrics.F1Score(average="micro")
    >>> m.update_state(np.array([0, 1, 1]), np.array([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]]))
    >>> round(float(m.result()), 4)
    0.6667
    """

    def __init__(self, average: str | None = None, threshold: float | None = None, name: str = "f1_score",
                 dtype: Any = "float32", num_classes: int | None = None):
        super().__init__(average=average, beta=1.0, threshold=threshold, name=name, dtype=dtype,
                         num_classes=num_classes)
