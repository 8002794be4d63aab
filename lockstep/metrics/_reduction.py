"""`Mean`, `Sum`, `Min`, `Max` and `MeanMetricWrapper` (an exact sample-weighted mean)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._base import Metric, State, divide_no_nan


def samplewise(values: Any, weight: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Per-sample weighted values and per-sample weights, the way Keras' `Mean` reduces them.

    A scalar value (say, a per-replica loss) counts with the weight of all the replica's samples.
    """
    v = jnp.asarray(values, jnp.float32)
    if v.ndim == 0:
        w = jnp.ones(()) if weight is None else jnp.sum(weight)
        return jnp.where(w != 0, v * w, 0.0)[None], w[None]
    if weight is None:
        if v.ndim > 1:
            v = jnp.mean(v, axis=tuple(range(1, v.ndim)))
        return v, jnp.ones(v.shape, jnp.float32)
    w = jnp.asarray(weight, jnp.float32)
    if w.ndim == v.ndim + 1 and w.shape[-1] == 1:
        w = w[..., 0]
    elif v.ndim == w.ndim + 1 and v.shape[-1] == 1:
        v = v[..., 0]
    if v.ndim > w.ndim:
        v = jnp.mean(v, axis=tuple(range(w.ndim, v.ndim)))
    w = jnp.broadcast_to(w, v.shape)
    v = jnp.where(w != 0, v * w, 0.0)
    if w.ndim > 1:
        w = jnp.mean(w, axis=tuple(range(1, w.ndim)))
        v = jnp.mean(v, axis=tuple(range(1, v.ndim)))
    return v, w


class Mean(Metric):
    """The (weighted) mean of the values given: sum(value·weight) / sum(weight).

    >>> import lockstep as ls
    >>> m = ls.metrics.Mean()
    >>> m.update_state([1.0, 3.0, 5.0], sample_weight=[1.0, 1.0, 0.0])
    >>> float(m.result())
    2.0
    """

    def __init__(self, name: str | None = None, dtype: Any = "float32"):
        super().__init__(name=name, dtype=dtype)
        self.add_state("total")
        self.add_state("count")

    def batch_state(self, values: Any, sample_weight: Any = None) -> State:
        v, w = samplewise(values, sample_weight)
        return {"total": jnp.sum(v), "count": jnp.sum(w)}

    def result_from(self, state: State) -> jax.Array:
        return divide_no_nan(state["total"], state["count"])


class Sum(Metric):
    """The (weighted) sum of the values given.

    >>> import lockstep as ls
    >>> m = ls.metrics.Sum(); m.update_state([1.0, 2.0]); float(m.result())
    3.0
    """

    def __init__(self, name: str | None = None, dtype: Any = "float32"):
        super().__init__(name=name, dtype=dtype)
        self.add_state("total")

    def batch_state(self, values: Any, sample_weight: Any = None) -> State:
        v = jnp.asarray(values, jnp.float32)
        if v.ndim == 0:
            has = jnp.ones((), bool) if sample_weight is None else jnp.sum(sample_weight) > 0
            return {"total": jnp.where(has, v, 0.0)}
        w = jnp.ones(v.shape, jnp.float32) if sample_weight is None else sample_weight
        w = jnp.broadcast_to(jnp.asarray(w).reshape(jnp.shape(w) + (1,) * (v.ndim - jnp.ndim(w))), v.shape)
        return {"total": jnp.sum(jnp.where(w != 0, v * w, 0.0))}

    def result_from(self, state: State) -> jax.Array:
        return state["total"]


class _Extremum(Metric):
    _reduction = "max"

    def __init__(self, name: str | None = None, dtype: Any = "float32"):
        super().__init__(name=name, dtype=dtype)
        self.add_state("value", reduction=self._reduction)
        self.add_state("count")

    def batch_state(self, values: Any, sample_weight: Any = None) -> State:
        v = jnp.asarray(values, jnp.float32)
        w = jnp.ones(v.shape) if sample_weight is None else jnp.broadcast_to(
            jnp.asarray(sample_weight).reshape(jnp.shape(sample_weight) + (1,) * (v.ndim - jnp.ndim(sample_weight))),
            v.shape)
        fill = -jnp.inf if self._reduction == "max" else jnp.inf
        picked = jnp.where(w > 0, v, fill)
        value = jnp.max(picked) if self._reduction == "max" else jnp.min(picked)
        return {"value": value, "count": jnp.sum(w > 0).astype(jnp.float32)}

    def result_from(self, state: State) -> jax.Array:
        return jnp.where(state["count"] > 0, state["value"], 0.0)


class Max(_Extremum):
    """The largest value given (samples with weight 0 ignored); 0 before any data.

    >>> import lockstep as ls
    >>> m = ls.metrics.Max(); m.update_state([1.0, 7.0, 3.0], sample_weight=[1, 0, 1]); float(m.result())
    3.0
    """

    _reduction = "max"


class Min(_Extremum):
    """The smallest value given (samples with weight 0 ignored); 0 before any data."""

    _reduction = "min"


class MeanMetricWrapper(Mean):
    """Wraps a per-sample function `fn(y_true, y_pred, **kwargs)` as an exact weighted mean.

    Like Keras' `MeanMetricWrapper`: the state is (sum of values, sum of weights), so the
    result is exact on any number of replicas.

    >>> import jax.numpy as jnp, lockstep as ls
    >>> def within(y_true, y_pred, tol):
    ...     return (jnp.abs(y_true - y_pred) < tol).astype(jnp.float32)
    >>> m = ls.metrics.MeanMetricWrapper(within, name="within_half", tol=0.5)
    >>> m.update_state(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([1.1, 2.9, 3.2, 4.0]))
    >>> float(m.result())
    0.75
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, dtype: Any = "float32", **kwargs: Any):
        if not callable(fn):
            raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
        super().__init__(name=name or getattr(fn, "__name__", "mean_metric_wrapper"), dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:  # type: ignore[override]
        values = self._fn(jnp.asarray(y_true), jnp.asarray(y_pred), **self._fn_kwargs)
        if jnp.ndim(values) == 0 and jnp.ndim(y_true) > 0:
            raise ValueError(
                f"the metric function `{self.name}` returns one value for a whole batch (shape ()), not one per "
                "sample: Keras averages such values batch by batch, a number that depends on the batch size and, "
                "split over replicas, on their number, so no exact equivalent exists. Return one value per sample "
                "(shape (batch,)): Keras and lockstep then average them exactly; for a statistic of the whole data "
                "(an RMSE, say) subclass keras.metrics.Metric (or lockstep.metrics.Metric) keeping sums.")
        return super().batch_state(values, sample_weight=sample_weight)
