"""Thresholded confusion counts: `Precision`, `Recall`, `AUC` (binned, Keras' thresholds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._base import Metric, State, divide_no_nan, expand_weight, same_rank

EPSILON = 1e-7
NEG_INF = -1e10


def _check_thresholds(thresholds: Sequence[float], arg: str = "thresholds") -> None:
    bad = [t for t in thresholds if not 0.0 <= float(t) <= 1.0]
    if bad:
        raise ValueError(f"`{arg}` must lie in [0, 1], got {arg}={list(thresholds)}.")


def _parse_thresholds(thresholds: float | Sequence[float] | None, default: float) -> tuple[list[float], bool]:
    if thresholds is None:
        return [default], True
    if isinstance(thresholds, (int, float)):
        _check_thresholds([thresholds])
        return [float(thresholds)], True
    values = [float(t) for t in thresholds]
    if not values:
        raise ValueError("`thresholds` must hold at least one value, got an empty list.")
    _check_thresholds(values)
    return values, len(values) == 1  # one threshold in a list: a scalar result, as in Keras


def _filter_top_k(y_pred: jax.Array, k: int) -> jax.Array:
    """Keeps the `k` largest scores of each row (ties: lowest index first, as `top_k`), the rest -1e10."""
    idx = jax.lax.top_k(y_pred, k)[1]
    keep = jnp.sum(jax.nn.one_hot(idx, y_pred.shape[-1], dtype=y_pred.dtype), axis=-2)
    return y_pred * keep + NEG_INF * (1 - keep)


def confusion_counts(y_true: Any, y_pred: Any, weight: jax.Array | None, thresholds: jax.Array,
                     top_k: int | None = None, class_id: int | None = None,
                     per_label: bool = False) -> dict[str, jax.Array]:
    """Weighted tp / fp / tn / fn at each threshold (prediction positive when `y_pred > t`)."""
    y_true, y_pred = same_rank(y_true, y_pred, jnp.float32)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"`y_true` and `y_pred` must have the same shape, got {y_true.shape} and {y_pred.shape}.")
    w = expand_weight(weight, y_true)
    if top_k is not None:
        y_pred = _filter_top_k(y_pred, top_k)
    if class_id is not None:
        y_true, y_pred, w = y_true[..., class_id], y_pred[..., class_id], w[..., class_id]
    if per_label:
        y_true, y_pred, w = (a.reshape(-1, a.shape[-1]) for a in (y_true, y_pred, w))
        t = thresholds[:, None, None]  # (T, 1, 1) against (n, L)
        axis = 1
    else:
        y_true, y_pred, w = y_true.reshape(-1), y_pred.reshape(-1), w.reshape(-1)
        t = thresholds[:, None]  # (T, 1) against (n,)
        axis = 1
    pos = y_pred[None] > t
    wt = jnp.where(w != 0, w * y_true, 0.0)[None]
    wf = jnp.where(w != 0, w * (1.0 - y_true), 0.0)[None]
    return {
        "true_positives": jnp.sum(jnp.where(pos, wt, 0.0), axis=axis),
        "false_positives": jnp.sum(jnp.where(pos, wf, 0.0), axis=axis),
        "true_negatives": jnp.sum(jnp.where(pos, 0.0, wf), axis=axis),
        "false_negatives": jnp.sum(jnp.where(pos, 0.0, wt), axis=axis),
    }


class _ThresholdMetric(Metric):
    _fields: tuple[str, ...] = ()

    def __init__(self, thresholds: float | Sequence[float] | None = None, top_k: int | None = None,
                 class_id: int | None = None, name: str | None = None, dtype: Any = "float32"):
        super().__init__(name=name, dtype=dtype)
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"`top_k` must be a positive integer or None, got top_k={top_k!r}.")
        if class_id is not None and (not isinstance(class_id, int) or class_id < 0):
            raise ValueError(f"`class_id` must be a non-negative integer or None, got class_id={class_id!r}.")
        default = NEG_INF if top_k is not None else 0.5
        self.thresholds, self._scalar = _parse_thresholds(thresholds, default)
        self.top_k, self.class_id = top_k, class_id
        for field in self._fields:
            self.add_state(field, shape=(len(self.thresholds),))

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        counts = confusion_counts(y_true, y_pred, sample_weight, jnp.asarray(self.thresholds, jnp.float32),
                                  self.top_k, self.class_id)
        return {k: counts[k] for k in self._fields}

    def _out(self, value: jax.Array) -> jax.Array:
        return value[0] if self._scalar else value


class Precision(_ThresholdMetric):
    """tp / (tp + fp) at each threshold (`y_pred > threshold` is a positive prediction).

    Args:
      thresholds: a float or a list of floats in [0, 1] (default 0.5); a list of several gives
        one precision per threshold (a list of one, a scalar, as in Keras).
      top_k: only the `top_k` largest predictions of each sample count as positive.
      class_id: compute the metric for this class (column) only.

    >>> import lockstep as ls
    >>> m = ls.metrics.Precision(); m.update_state([0, 1, 1, 1], [1, 0, 1, 1]); round(float(m.result()), 4)
    0.6667
    """

    direction = "up"

    _fields = ("true_positives", "false_positives")

    def __init__(self, thresholds: float | Sequence[float] | None = None, top_k: int | None = None,
                 class_id: int | None = None, name: str = "precision", dtype: Any = "float32"):
        super().__init__(thresholds, top_k, class_id, name, dtype)

    def result_from(self, state: State) -> jax.Array:
        tp, fp = state["true_positives"], state["false_positives"]
        return self._out(divide_no_nan(tp, tp + fp))


class Recall(_ThresholdMetric):
    """tp / (tp + fn) at each threshold; arguments as for `Precision`.

    >>> import lockstep as ls
    >>> m = ls.metrics.Recall(); m.update_state([0, 1, 1, 1], [1, 0, 1, 1]); round(float(m.result()), 4)
    0.6667
    """

    direction = "up"

    _fields = ("true_positives", "false_negatives")

    def __init__(self, thresholds: float | Sequence[float] | None = None, top_k: int | None = None,
                 class_id: int | None = None, name: str = "recall", dtype: Any = "float32"):
        super().__init__(thresholds, top_k, class_id, name, dtype)

    def result_from(self, state: State) -> jax.Array:
        tp, fn = state["true_positives"], state["false_negatives"]
        return self._out(divide_no_nan(tp, tp + fn))


class AUC(Metric):
    """Area under the ROC or precision-recall curve, from confusion counts at fixed thresholds.

    Binned as Keras' `AUC` (same thresholds, same Riemann sums), so the state is
    ``4 × num_thresholds`` numbers whatever the data size, and the result equals Keras'.
    The binning error against the exact (scikit-learn) value shrinks as `num_thresholds` grows.

    Args:
      num_thresholds: number of thresholds (> 1), evenly spaced in [0, 1].
      curve: ``"ROC"`` or ``"PR"``.
      summation_method: ``"interpolation"``, ``"minoring"`` or ``"majoring"``.
      thresholds: explicit thresholds in [0, 1] instead of `num_thresholds`.
      multi_label: one curve per label (columns of `y_true`), averaged; else all flattened.
      num_labels: number of labels, when `multi_label` (else inferred from the first batch).
      from_logits: apply a sigmoid to `y_pred` first.

    >>> import lockstep as ls
    >>> m = ls.metrics.AUC(num_thresholds=3)
    >>> m.update_state([0, 0, 1, 1], [0.0, 0.5, 0.3, 0.9]); round(float(m.result()), 4)
    0.75
    """

    direction = "up"

    _FIELDS = ("true_positives", "false_positives", "true_negatives", "false_negatives")

    def __init__(self, num_thresholds: int = 200, curve: str = "ROC", summation_method: str = "interpolation",
                 name: str = "auc", dtype: Any = "float32", thresholds: Sequence[float] | None = None,
                 multi_label: bool = False, num_labels: int | None = None, from_logits: bool = False):
        super().__init__(name=name, dtype=dtype)
        curve = str(curve).upper()
        if curve not in ("ROC", "PR"):
            raise ValueError(f"`curve` must be 'ROC' or 'PR', got curve={curve!r}.")
        if summation_method not in ("interpolation", "minoring", "majoring"):
            raise ValueError("`summation_method` must be 'interpolation', 'minoring' or 'majoring', "
                             f"got summation_method={summation_method!r}.")
        if thresholds is not None:
            inner = sorted(float(t) for t in thresholds)
            _check_thresholds(inner)
        else:
            if not isinstance(num_thresholds, int) or num_thresholds <= 1:
                raise ValueError(f"`num_thresholds` must be an integer > 1, got num_thresholds={num_thresholds!r}.")
            inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self.thresholds = np.array([0.0 - EPSILON, *inner, 1.0 + EPSILON], np.float32)
        self.num_thresholds = len(self.thresholds)
        self.curve, self.summation_method = curve, summation_method
        self.multi_label, self.from_logits = bool(multi_label), bool(from_logits)
        self._num_labels = num_labels
        if not self.multi_label:
            self._declare(())
        elif num_labels is not None:
            self._declare((num_labels,))

    def _declare(self, label_shape: tuple[int, ...]) -> None:
        for field in self._FIELDS:
            self.add_state(field, shape=(self.num_thresholds, *label_shape))

    @property
    def built(self) -> bool:
        return bool(self._specs)

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        self._num_labels = int(y_pred_shape[-1])
        self._declare((self._num_labels,))

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        y_pred = jnp.asarray(y_pred, jnp.float32)
        if self.from_logits:
            y_pred = jax.nn.sigmoid(y_pred)
        return confusion_counts(y_true, y_pred, sample_weight, jnp.asarray(self.thresholds),
                                per_label=self.multi_label)

    def result_from(self, state: State) -> jax.Array:
        tp, fp, tn, fn = (state[k] for k in self._FIELDS)
        if self.curve == "PR" and self.summation_method == "interpolation":
            terms = self._interpolate_pr(tp, fp, fn)
        else:
            recall = divide_no_nan(tp, tp + fn)
            if self.curve == "ROC":
                x, y = divide_no_nan(fp, fp + tn), recall
            else:
                x, y = recall, divide_no_nan(tp, tp + fp)
            if self.summation_method == "interpolation":
                heights = (y[:-1] + y[1:]) / 2.0
            elif self.summation_method == "minoring":
                heights = jnp.minimum(y[:-1], y[1:])
            else:
                heights = jnp.maximum(y[:-1], y[1:])
            terms = (x[:-1] - x[1:]) * heights
        by_label = jnp.sum(terms, axis=0)
        return jnp.mean(by_label) if self.multi_label else by_label

    @staticmethod
    def _interpolate_pr(tp: jax.Array, fp: jax.Array, fn: jax.Array) -> jax.Array:
        """Davis & Goadrich interpolation, the closed form Keras uses."""
        dtp = tp[:-1] - tp[1:]
        p = tp + fp
        dp = p[:-1] - p[1:]
        slope = divide_no_nan(dtp, jnp.maximum(dp, 0))
        intercept = tp[1:] - slope * p[1:]
        ratio = jnp.where((p[:-1] > 0) & (p[1:] > 0), divide_no_nan(p[:-1], jnp.maximum(p[1:], 0)),
                          jnp.ones_like(p[1:]))
        return divide_no_nan(slope * (dtp + intercept * jnp.log(ratio)), jnp.maximum(tp[1:] + fn[1:], 0))
