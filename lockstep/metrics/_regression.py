"""Regression metrics: `MeanSquaredError`, `MeanAbsoluteError`, `RootMeanSquaredError`, `R2Score`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._base import Metric, State, divide_no_nan, same_rank
from ._reduction import MeanMetricWrapper


def _pair(y_true: Any, y_pred: Any) -> tuple[jax.Array, jax.Array]:
    return same_rank(y_true, y_pred, jnp.float32)


def squared_error(y_true: Any, y_pred: Any) -> jax.Array:
    y_true, y_pred = _pair(y_true, y_pred)
    return jnp.square(y_true - y_pred)


def absolute_error(y_true: Any, y_pred: Any) -> jax.Array:
    y_true, y_pred = _pair(y_true, y_pred)
    return jnp.abs(y_true - y_pred)


class MeanSquaredError(MeanMetricWrapper):
    """Mean of squared errors (per sample averaged over the last axes, then weighted over samples)."""

    direction = "down"

    def __init__(self, name: str = "mean_squared_error", dtype: Any = "float32"):
        super().__init__(squared_error, name=name, dtype=dtype)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean of absolute errors."""

    direction = "down"

    def __init__(self, name: str = "mean_absolute_error", dtype: Any = "float32"):
        super().__init__(absolute_error, name=name, dtype=dtype)


class RootMeanSquaredError(MeanMetricWrapper):
    """Square root of the mean squared error (the root is taken of the exact global mean).

    >>> import lockstep as ls
    >>> m = ls.metrics.RootMeanSquaredError(); m.update_state([0.0, 0.0], [3.0, 4.0]); round(float(m.result()), 4)
    3.5355
    """

    direction = "down"

    def __init__(self, name: str = "root_mean_squared_error", dtype: Any = "float32"):
        super().__init__(squared_error, name=name, dtype=dtype)

    def result_from(self, state: State) -> jax.Array:
        return jnp.sqrt(super().result_from(state))


class R2Score(Metric):
    """Coefficient of determination, as `sklearn.metrics.r2_score` and Keras' `R2Score`.

    Args:
      class_aggregation: ``"uniform_average"``, ``"variance_weighted_average"`` or ``None``
        (one score per output).
      num_regressors: for the adjusted R², the number of regressors (0: plain R²). The adjusted
        score uses n = the number of samples with non-zero weight (Keras uses the number of
        elements, which differs for several outputs); it falls back to R² when n - p - 1 <= 0.
      num_outputs: outputs per sample; ``None`` to infer it from the first batch.

    Note: states are float32 sums (Σw, Σwy, Σwy², Σw·residual²), so the total sum of squares
    is formed as Σwy² − (Σwy)²/Σw; on data far from zero mean this loses digits.

    >>> import lockstep as ls
    >>> m = ls.metrics.R2Score(); m.update_state([1.0, 2.0, 3.0, 4.0], [1.1, 1.9, 3.2, 3.7])
    >>> round(float(m.result()), 4)
    0.97
    """

    direction = "up"

    def __init__(self, class_aggregation: str | None = "uniform_average", num_regressors: int = 0,
                 num_outputs: int | None = None, name: str = "r2_score", dtype: Any = "float32"):
        if class_aggregation not in ("uniform_average", "variance_weighted_average", None):
            raise ValueError("`class_aggregation` must be 'uniform_average', 'variance_weighted_average' or "
                             f"None, got class_aggregation={class_aggregation!r}.")
        if not isinstance(num_regressors, int) or num_regressors < 0:
            raise ValueError(f"`num_regressors` must be a non-negative integer, got {num_regressors!r}.")
        super().__init__(name=name, dtype=dtype)
        self.class_aggregation = class_aggregation
        self.num_regressors = num_regressors
        self._num_outputs = num_outputs
        self._vector = False
        if num_outputs is not None:
            self._declare(num_outputs)

    def _declare(self, k: int) -> None:
        self._num_outputs = k
        for field in ("count", "sum", "squared_sum", "residual"):
            self.add_state(field, shape=(k,))
        self.add_state("num_samples")

    @property
    def built(self) -> bool:
        return self._num_outputs is not None

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        shape = tuple(y_pred_shape)
        self._vector = len(shape) > 1 and shape[-1] > 1
        self._declare(shape[-1] if self._vector else 1)

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        y_true, y_pred = _pair(y_true, y_pred)
        k = self._num_outputs
        y_true, y_pred = y_true.reshape(y_true.shape[0], k), y_pred.reshape(y_pred.shape[0], k)
        w = jnp.ones(y_true.shape) if sample_weight is None else jnp.broadcast_to(
            jnp.asarray(sample_weight, jnp.float32).reshape(y_true.shape[0], -1), y_true.shape)
        wy = jnp.where(w != 0, w * y_true, 0.0)
        return {"count": jnp.sum(w, 0), "sum": jnp.sum(wy, 0),
                "squared_sum": jnp.sum(jnp.where(w != 0, wy * y_true, 0.0), 0),
                "residual": jnp.sum(jnp.where(w != 0, w * jnp.square(y_true - y_pred), 0.0), 0),
                "num_samples": jnp.sum(jnp.any(w != 0, axis=1)).astype(jnp.float32)}

    def result_from(self, state: State) -> jax.Array:
        mean = divide_no_nan(state["sum"], state["count"])
        total = state["squared_sum"] - state["sum"] * mean
        raw = 1.0 - divide_no_nan(state["residual"], total)
        raw = jnp.where(total == 0, jnp.where(state["residual"] == 0, 1.0, 0.0), raw)
        if self.class_aggregation is None:
            score = raw
        elif self.class_aggregation == "uniform_average":
            score = jnp.mean(raw)
        else:
            score = divide_no_nan(jnp.sum(raw * total), jnp.sum(total))
        if self.num_regressors:
            n = state["num_samples"]
            p = self.num_regressors
            score = jnp.where(n - p - 1 > 0, 1.0 - (1.0 - score) * divide_no_nan(n - 1, n - p - 1), score)
        return score
