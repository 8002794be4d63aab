"""`KerasMetric`: a `keras.metrics.Metric` object used as a lockstep metric, exactly.

Keras 3 metrics have a stateless face (`stateless_update_state`, `stateless_result`) and declare
how each variable combines across replicas (`aggregation`). Every built-in Keras metric
accumulates by addition (``aggregation="sum"``), so its variables are a lockstep state whose
fields reduce by ``"sum"``: one batch's contribution is the update of zeroed variables, and the
sum over batches and replicas is what one Keras object sees on the whole data.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._base import Metric, State


def is_keras_metric(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 metric object (duck-typed: Keras need not be imported)."""
    return type(obj).__module__.startswith("keras") and hasattr(obj, "stateless_update_state") and hasattr(
        obj, "stateless_result")


def _shaped(metric: Any) -> bool:
    """Whether a Keras metric has made all its variables (some make them on their first update)."""
    return bool(metric.variables) and getattr(metric, "_built", True)


class KerasMetric(Metric):
    """A Keras metric object as a lockstep metric: its variables are the state, its stateless
    API updates and computes, padding rows get weight 0.

    `ls.metrics.get` and `Trainer(metrics=[...])` wrap Keras metric objects with it.

    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, numpy as np, lockstep as ls
    >>> s = ls.MirroredStrategy(3)
    >>> m = ls.metrics.get(keras.metrics.AUC())
    >>> y, p = np.array([0, 1, 1, 0, 1]), np.array([0.1, 0.8, 0.3, 0.4, 0.9])
    >>> batch = next(iter(s.experimental_distribute_dataset([(y, p)])))
    >>> state = s.run(lambda st, b: m.update(st, b[0], b[1]), args=(m.init(), batch))
    >>> k = keras.metrics.AUC(); k.update_state(y, p)
    >>> bool(abs(float(m.compute(state)) - float(k.result())) < 1e-6)
    True

    Raises:
      ValueError: a variable of the metric does not combine by addition (a custom Keras metric
        with another `aggregation`), or does not start at zero.
    """

    def __init__(self, metric: Any):
        if not is_keras_metric(metric):
            raise TypeError(f"`metric` must be a keras.metrics.Metric, got {type(metric).__name__}.")
        super().__init__(name=metric.name, dtype=metric.dtype or "float32")
        self.keras_metric = metric
        self._names: list[str] = []
        if _shaped(metric):
            self._declare()

    @property
    def direction(self) -> str | None:  # type: ignore[override]
        name = type(self.keras_metric).__name__.lower()
        if any(k in name for k in ("error", "crossentropy", "hinge", "divergence", "poisson", "logcosh",
                                    "false")):
            return "down"
        return "up"

    @property
    def built(self) -> bool:
        return bool(self._names)

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        if not _shaped(self.keras_metric):  # F1Score, R2Score shape their variables on a first update
            k = self.keras_metric
            k.update_state(np.zeros((0, *y_true_shape[1:]), np.float32), np.zeros((0, *y_pred_shape[1:]), np.float32))
            k.reset_state()
        self._declare()

    def _declare(self) -> None:
        if self._names:
            return
        for i, v in enumerate(self.keras_metric.variables):
            if v.aggregation != "sum":
                raise ValueError(
                    f"Keras metric `{self.name}` has variable `{v.name}` with aggregation={v.aggregation!r}: "
                    "lockstep combines Keras metrics across batches and replicas by addition, so every "
                    "variable must declare aggregation='sum'. Write it as a lockstep.metrics.Metric instead.")
            if np.any(np.asarray(v.value) != 0):
                raise ValueError(f"Keras metric `{self.name}` has variable `{v.name}` that does not start at zero.")
            name = f"{i}_{v.name}"
            self.add_state(name, tuple(v.shape), reduction="sum", dtype=v.dtype)
            self._names.append(name)

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        zeros = [jnp.zeros(self._specs[k].shape, self._specs[k].dtype) for k in self._names]
        with warnings.catch_warnings():  # the padding mask is a float weight; Keras' int counters warn
            warnings.filterwarnings("ignore", message="You are passing weight as `float`")
            new = self.keras_metric.stateless_update_state(zeros, y_true, y_pred, sample_weight=sample_weight)
        return dict(zip(self._names, new))

    def result_from(self, state: State) -> Any:
        return self.keras_metric.stateless_result([state[k] for k in self._names])

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "keras_metric": self.keras_metric.get_config()}
