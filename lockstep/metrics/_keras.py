"""`KerasMetric`: a `keras.metrics.Metric` object used as a lockstep metric, exactly.

Keras 3 metrics have a stateless face (`stateless_update_state`, `stateless_result`) and declare
how each variable combines across replicas (`aggregation`). Every built-in Keras metric
accumulates by addition (``aggregation="sum"``), so its variables are a lockstep state whose
fields reduce by ``"sum"``: one batch's contribution is the update of zeroed variables, and the
sum over batches and replicas is what one Keras object sees on the whole data.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._base import Metric, State


class _OwnUpdate(threading.local):
    """Set while lockstep itself runs a Keras metric's update (with its own masks): the wrappers of
    `_keras_in_run` then step aside."""

    def __init__(self) -> None:
        self.on = False


OWN_UPDATE = _OwnUpdate()


@contextlib.contextmanager
def own_update() -> Iterator[None]:
    """Keras metrics' methods run as Keras' own inside the block (see `_keras_in_run`)."""
    before, OWN_UPDATE.on = OWN_UPDATE.on, True
    try:
        yield
    finally:
        OWN_UPDATE.on = before


def _from_keras(cls: type) -> bool:
    return cls.__module__.startswith("keras")


def is_keras_metric(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 metric object, a user's subclass included (duck-typed: Keras
    need not be imported)."""
    return (any(_from_keras(c) and c.__name__ == "Metric" for c in type(obj).__mro__)
            and hasattr(obj, "stateless_update_state") and hasattr(obj, "stateless_result"))


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

    A user's subclass is probed once, when its shapes are known, on two made-up rows: its update
    must add to its variables what the rows alone give (an RMSE's sums of squares and counts do;
    a running maximum does not, and is refused naming the variable). One that ignores
    `sample_weight` is updated row by row with the padding rows left out (vectorised), as Keras
    would see the real rows only; its user weights are then ignored, as in Keras.

    Raises:
      ValueError: a variable of the metric does not combine by addition (another `aggregation`,
        or an update that is not a sum over rows), or does not start at zero.
    """

    def __init__(self, metric: Any):
        if not is_keras_metric(metric):
            raise TypeError(f"`metric` must be a keras.metrics.Metric, got {type(metric).__name__}.")
        super().__init__(name=metric.name, dtype=metric.dtype or "float32")
        self.keras_metric = metric
        self._names: list[str] = []
        self._probed = _from_keras(type(metric))  # Keras' own metrics all accumulate sums
        self._per_row = False  # the metric ignores sample_weight: rows are masked one by one
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
        return bool(self._names) and self._probed

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        if not _shaped(self.keras_metric):  # F1Score, R2Score shape their variables on a first update
            k = self.keras_metric
            k.update_state(np.zeros((0, *y_true_shape[1:]), np.float32), np.zeros((0, *y_pred_shape[1:]), np.float32))
            k.reset_state()
        self._declare()
        if not self._probed:
            self._probe(tuple(y_true_shape[1:]), tuple(y_pred_shape[1:]))
            self._probed = True

    def _probe(self, true_row: tuple[int, ...], pred_row: tuple[int, ...]) -> None:
        """Checks on two made-up rows that an update adds to the variables what each row alone
        gives (whatever the state it starts from), and whether it honours `sample_weight`."""
        rng = np.random.default_rng(0)
        y_true = rng.integers(0, 2, size=(2, *true_row)).astype(np.float32)  # labels, 0/1 targets or values
        y_pred = rng.uniform(0.1, 0.9, size=(2, *pred_row)).astype(np.float32)
        zeros = [jnp.zeros(self._specs[k].shape, self._specs[k].dtype) for k in self._names]
        k = self.keras_metric

        def up(state: list[Any], rows: slice, weight: Any = None) -> list[Any]:
            return self._update(state, y_true[rows], y_pred[rows], weight)

        first, second = up(zeros, slice(0, 1)), up(zeros, slice(1, 2))
        both, then = up(zeros, slice(0, 2)), up(first, slice(1, 2))
        for name, v, a, b, ab, seq in zip(self._names, k.variables, first, second, both, then):
            total = np.asarray(a, np.float64) + np.asarray(b, np.float64)
            for how, got in (("one batch of both rows", ab), ("one row after the other", seq)):
                if not np.allclose(np.asarray(got, np.float64), total, rtol=1e-5, atol=1e-6):
                    raise ValueError(
                        f"Keras metric `{self.name}` ({type(k).__name__}) cannot be combined exactly across batches, "
                        f"replicas and workers: its variable `{v.name}` after {how} is {np.asarray(got).tolist()}, "
                        f"not the sum of what each row alone gives ({total.tolist()}). lockstep adds up the updates "
                        "of zeroed variables, which is exact for metrics that accumulate sums over samples (as "
                        "Keras' own do); a maximum, a minimum or a last value is not. Write it as a "
                        "lockstep.metrics.Metric, whose add_state(..., reduction='max' / 'min' / 'cat') says how "
                        "its state combines.")
        try:
            weighed = up(zeros, slice(0, 1), np.zeros(1, np.float32))
        except TypeError:  # update_state(self, y_true, y_pred): no sample_weight at all
            weighed = first
        self._per_row = any(np.any(np.asarray(v) != 0) for v in weighed)

    def update(self, state: State, *args: Any, sample_weight: Any = None, mask: Any = None) -> State:
        if not self.built:
            self.build(*(jnp.shape(a) for a in args[:2]))
        if self._per_row:  # it ignores sample_weight (so would Keras): only the padding mask counts
            sample_weight = None
        return super().update(state, *args, sample_weight=sample_weight, mask=mask)

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
        if self._per_row:
            rows = jax.vmap(lambda t, p: self._update(zeros, t[None], p[None], None))(y_true, y_pred)
            weight = jnp.ones(jnp.shape(y_true)[:1]) if sample_weight is None else sample_weight
            new = [jnp.tensordot(weight, r, axes=1).astype(r.dtype) for r in rows]  # padding rows: weight 0
        else:
            new = self._update(zeros, y_true, y_pred, sample_weight)
        return dict(zip(self._names, new))

    def _update(self, state: list[Any], y_true: Any, y_pred: Any, sample_weight: Any) -> list[Any]:
        with warnings.catch_warnings(), own_update():  # the padding mask is a float weight; Keras' int counters warn
            warnings.filterwarnings("ignore", message="You are passing weight as `float`")
            weight = {} if sample_weight is None else {"sample_weight": sample_weight}
            return list(self.keras_metric.stateless_update_state(state, y_true, y_pred, **weight))

    def result_from(self, state: State) -> Any:
        return self.keras_metric.stateless_result([state[k] for k in self._names])

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "keras_metric": self.keras_metric.get_config()}
