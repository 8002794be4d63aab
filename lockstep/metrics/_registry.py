"""Metric names resolved the Keras way (`"accuracy"`, `"mse"`, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _accuracy as acc
from ._base import Metric, State
from ._confusion import AUC, Precision, Recall
from ._fbeta import F1Score
from ._keras import KerasMetric, is_keras_metric
from ._reduction import MeanMetricWrapper
from ._regression import MeanAbsoluteError, MeanSquaredError, R2Score, RootMeanSquaredError


class _AutoAccuracy(Metric):
    """`"accuracy"`: binary, sparse or categorical accuracy, picked from the shapes (as Keras does)."""

    direction = "up"

    def __init__(self, name: str = "accuracy"):
        super().__init__(name=name)
        self._inner: Metric | None = None

    @property
    def built(self) -> bool:
        return self._inner is not None

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        if len(y_pred_shape) <= 1 or y_pred_shape[-1] == 1:
            self._inner = acc.BinaryAccuracy(name=self.name)
        elif len(y_true_shape) < len(y_pred_shape) or y_true_shape[-1] == 1:
            self._inner = acc.SparseCategoricalAccuracy(name=self.name)
        else:
            self._inner = acc.CategoricalAccuracy(name=self.name)
        self._specs = self._inner.state_specs

    def batch_state(self, *args: Any, sample_weight: Any = None) -> State:
        assert self._inner is not None
        return self._inner.batch_state(*args, sample_weight=sample_weight)

    def result_from(self, state: State) -> Any:
        assert self._inner is not None
        return self._inner.result_from(state)


_NAMES: dict[str, Callable[[], Metric]] = {
    "accuracy": _AutoAccuracy,
    "acc": _AutoAccuracy,
    "binary_accuracy": acc.BinaryAccuracy,
    "categorical_accuracy": acc.CategoricalAccuracy,
    "sparse_categorical_accuracy": acc.SparseCategoricalAccuracy,
    "top_k_categorical_accuracy": acc.TopKCategoricalAccuracy,
    "sparse_top_k_categorical_accuracy": acc.SparseTopKCategoricalAccuracy,
    "mse": lambda: MeanSquaredError(name="mse"),
    "mean_squared_error": MeanSquaredError,
    "mae": lambda: MeanAbsoluteError(name="mae"),
    "mean_absolute_error": MeanAbsoluteError,
    "rmse": lambda: RootMeanSquaredError(name="rmse"),
    "root_mean_squared_error": RootMeanSquaredError,
    "precision": Precision,
    "recall": Recall,
    "auc": AUC,
    "f1_score": lambda: F1Score(average="macro"),
    "r2_score": R2Score,
}


def get(identifier: Metric | str | Callable[..., Any]) -> Metric:
    """A metric from a `Metric` (returned as is), a Keras metric object (as a `KerasMetric`), a
    Keras name, or a per-sample function.

    >>> import lockstep as ls
    >>> type(ls.metrics.get("mse")).__name__, ls.metrics.get("mse").name
    ('MeanSquaredError', 'mse')

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(identifier, Metric):
        return identifier
    if is_keras_metric(identifier):
        return KerasMetric(identifier)
    if isinstance(identifier, str):
        factory = _NAMES.get(identifier.lower())
        if factory is None:
            raise ValueError(f"`metrics` names an unknown metric {identifier!r}; known names: {sorted(_NAMES)}.")
        return factory()
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise TypeError(f"a metric must be a lockstep Metric, a name or a function, got {identifier!r}.")
