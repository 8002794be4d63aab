"""`ConfusionMatrix`: weighted counts of (true class, predicted class)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._base import Metric, State, check_labels


class ConfusionMatrix(Metric):
    """Rows are true classes, columns predicted classes (scikit-learn's layout).

    `y_true` holds integer labels; `y_pred` integer labels or per-class scores (arg-max taken).

    >>> import lockstep as ls
    >>> m = ls.metrics.ConfusionMatrix(num_classes=2)
    >>> m.update_state([0, 1, 1], [0, 0, 1]); m.result().astype(int).tolist()
    [[1, 0], [1, 1]]
    """

    def __init__(self, num_classes: int, name: str = "confusion_matrix", dtype: Any = "float32"):
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"`num_classes` must be a positive integer, got num_classes={num_classes!r}.")
        super().__init__(name=name, dtype=dtype)
        self.num_classes = num_classes
        self.add_state("matrix", shape=(num_classes, num_classes))

    def _labels(self, y_true: Any, y_pred: Any) -> tuple[jax.Array, jax.Array]:
        y_true, y_pred = jnp.asarray(y_true), jnp.asarray(y_pred)
        if y_true.ndim > 1:
            y_true = y_true.reshape(y_true.shape[0])
        if y_pred.ndim > 1 and y_pred.shape[-1] > 1:
            y_pred = jnp.argmax(y_pred, -1)
        return y_true.astype(jnp.int32), y_pred.reshape(y_true.shape).astype(jnp.int32)

    def check_inputs(self, *args: Any) -> None:
        y_true, y_pred = self._labels(args[0], args[1])
        check_labels(y_true, self.num_classes, "y_true")
        check_labels(y_pred, self.num_classes, "y_pred")

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        t, p = self._labels(y_true, y_pred)
        w = jnp.ones(t.shape, jnp.float32) if sample_weight is None else jnp.asarray(sample_weight, jnp.float32)
        k = self.num_classes
        valid = (t >= 0) & (t < k) & (p >= 0) & (p < k)  # traced labels cannot raise: never miscount them
        flat = jnp.where(valid, t * k + p, 0)
        w = jnp.where(valid, w, 0.0)
        counts = jax.ops.segment_sum(w, flat, num_segments=self.num_classes ** 2)
        return {"matrix": counts.reshape(self.num_classes, self.num_classes)}

    def result_from(self, state: State) -> jax.Array:
        return state["matrix"]
