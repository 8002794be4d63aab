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

from ..engine import get_replica_context
from ..losses import keras_mask
from ._base import Metric, State, _effective_weight


class _OwnUpdate(threading.local):
    """Set while lockstep itself runs a Keras metric's update (with its own masks): the wrappers of
    `lockstep.keras`'s metrics in `run` then step aside."""

    def __init__(self) -> None:
        self.on = False


OWN_UPDATE = _OwnUpdate()


@contextlib.contextmanager
def own_update() -> Iterator[None]:
    """Keras metrics' methods run as Keras' own inside the block (see `lockstep.keras`'s metrics in `run`)."""
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

    A user's subclass is probed once, when its shapes are known, on two made-up rows: each of its
    variables must combine what the rows alone give by a sum (an RMSE's sums of squares and
    counts), a maximum or a minimum (a running maximum); anything else (a last value) is refused
    naming the variable. One that ignores `sample_weight`, or keeps a maximum or minimum, is
    updated row by row with the padding rows left out (vectorised), as Keras would see the real
    rows only; a metric that ignores `sample_weight` ignores the user's weights, as in Keras.

    Raises:
      ValueError: a variable of the metric combines rows by no sum, maximum or minimum, or a
        Keras metric's own sum does not start at zero.
    """

    def __init__(self, metric: Any):
        if not is_keras_metric(metric):
            raise TypeError(f"`metric` must be a keras.metrics.Metric, got {type(metric).__name__}.")
        super().__init__(name=metric.name, dtype=metric.dtype or "float32")
        self.keras_metric = metric
        self._names: list[str] = []
        self._probed = _from_keras(type(metric))  # Keras' own metrics all accumulate sums
        self._per_row = False  # rows are updated one by one, the padding rows left out
        self._ignores_weight = False  # its update does not read sample_weight (a count over samples)
        self._inits: list[Any] = []  # the variables' values before any update
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
        """Finds on two made-up rows how each variable combines what each row alone gives (whatever
        the state it starts from): a sum, a maximum or a minimum; and whether the update honours
        `sample_weight`."""
        rng = np.random.default_rng(0)
        y_true = rng.integers(0, 2, size=(2, *true_row)).astype(np.float32)  # labels, 0/1 targets or values
        y_pred = rng.uniform(0.1, 0.9, size=(2, *pred_row)).astype(np.float32)
        k = self.keras_metric

        def up(state: list[Any], rows: slice, weight: Any = None) -> list[Any]:
            return [np.asarray(v, np.float64) for v in self._update(state, y_true[rows], y_pred[rows], weight)]

        first, second = up(self._inits, slice(0, 1)), up(self._inits, slice(1, 2))
        both, then = up(self._inits, slice(0, 2)), up(first, slice(1, 2))
        twice = up(second, slice(1, 2))  # a row seen again: a sum counts it twice, a maximum once
        reductions = []
        for v, init, a, b, ab, seq, bb in zip(k.variables, self._inits, first, second, both, then, twice):
            init = np.asarray(init, np.float64)
            combined = {"sum": (a + b - init, 2 * b - init), "max": (np.maximum(a, b), b), "min": (np.minimum(a, b), b)}
            fits = [r for r, (want, again) in combined.items()
                    if all(np.allclose(got, want, rtol=1e-5, atol=1e-6) for got in (ab, seq))
                    and np.allclose(bb, again, rtol=1e-5, atol=1e-6) and (r != "sum" or not np.any(init != 0))]
            if not fits:
                raise ValueError(
                    f"Keras metric `{self.name}` ({type(k).__name__}) cannot be combined exactly across batches, "
                    f"replicas and workers: its variable `{v.name}` after one batch of both rows is {ab.tolist()} "
                    f"and after one row after the other {seq.tolist()}, neither the sum ({combined['sum'][0].tolist()}) "
                    f"nor the maximum or minimum of what each row alone gives. lockstep combines the updates of "
                    "each batch's real rows, which is exact for variables that accumulate sums (starting at zero), "
                    "maxima or minima; a last value or a mean of means is not. Write it as a "
                    "lockstep.metrics.Metric, whose add_state(..., reduction='cat') keeps every row.")
            reductions.append(fits[0])
        try:
            weighed = up(self._inits, slice(0, 1), np.zeros(1, np.float32))
        except TypeError:  # update_state(self, y_true, y_pred): no sample_weight at all
            weighed = first
        self._ignores_weight = any(np.any(w != np.asarray(i)) for w, i in zip(weighed, self._inits))
        self._per_row = self._ignores_weight or any(r != "sum" for r in reductions)
        for name, init, reduction in zip(self._names, self._inits, reductions):
            spec = self._specs[name]
            self._specs[name] = spec._replace(reduction=reduction, fill=np.asarray(init, spec.dtype))

    def update(self, state: State, *args: Any, sample_weight: Any = None, mask: Any = None) -> State:
        if not self.built:
            self.build(*(jnp.shape(a) for a in args[:2]))
        if not self._ignores_weight:
            return super().update(state, *args, sample_weight=sample_weight, mask=mask)
        if mask is None:  # a variable counts rows whatever their weight: the mask apart from the user's weight
            ctx = get_replica_context()
            mask = None if ctx is None else ctx.mask
        real = _effective_weight(args, None, mask)
        return self.merge(state, self.batch_state(*args, sample_weight=_effective_weight(args, sample_weight, None),
                                                  real=jnp.ones(jnp.shape(args[0])[:1]) if real is None else real))

    def _declare(self) -> None:
        if self._names:
            return
        with jax.ensure_compile_time_eval():  # also when first wrapped inside a traced step
            reset = self.keras_metric.stateless_reset_state()  # the values Keras starts each epoch from
        for i, (v, value) in enumerate(zip(self.keras_metric.variables, reset)):
            init = np.asarray(value)
            if self._probed and np.any(init != 0):  # Keras' own metrics: sums, from zero
                raise ValueError(f"Keras metric `{self.name}` has variable `{v.name}` that does not start at zero.")
            name = f"{i}_{v.name}"
            self.add_state(name, tuple(v.shape), reduction="sum", dtype=v.dtype)
            self._names.append(name)
            self._inits.append(np.asarray(init, dtype=np.dtype(v.dtype)))  # NumPy: no tracer when made in a trace

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None, real: Any = None) -> State:
        """One batch's part of the state. `real` (1 for the rows that count, 0 for padding), apart
        from the user's `sample_weight`: where a variable counts rows whatever their weight (Keras
        counts a row of weight 0 there), each real row is updated with its own weight; without it,
        `sample_weight` stands for both."""
        if real is not None and not self._ignores_weight:
            sample_weight, real = _effective_weight((y_true, y_pred), sample_weight, real), None
        if not self._per_row:
            zeros = [jnp.zeros(self._specs[k].shape, self._specs[k].dtype) for k in self._names]
            return dict(zip(self._names, self._update(zeros, y_true, y_pred, sample_weight)))
        if keras_mask(y_pred) is not None:
            raise ValueError(
                f"Keras metric `{self.name}` ({type(self.keras_metric).__name__}) is updated row by row (its variables "
                "keep a maximum or minimum, or count rows whatever their weight), which loses the Keras mask the "
                "model's output carries (Embedding(mask_zero=True) or Masking): its value would count masked elements. "
                "Drop the mask before the output, or use a metric that adds up over rows.")
        n = jnp.shape(y_true)[0]
        if n == 0:  # no row: nothing changes
            return {name: jnp.asarray(init, self._specs[name].dtype) if self._specs[name].reduction != "sum"
                    else jnp.zeros(self._specs[name].shape, self._specs[name].dtype)
                    for name, init in zip(self._names, self._inits)}
        weight = jnp.ones((n,), jnp.float32) if sample_weight is None else jnp.asarray(sample_weight, jnp.float32)
        weight = jnp.broadcast_to(weight, (n,)) if weight.ndim == 0 else weight
        own = sample_weight is not None and (real is not None or not self._ignores_weight)  # each row's own weight
        row_weight = None if not self._ignores_weight else weight if real is None else jnp.broadcast_to(
            jnp.asarray(real, jnp.float32), (n,))

        def one(t: Any, p: Any, w: Any) -> list[Any]:
            return self._update(self._inits, t[None], p[None], w[None] if own else None)

        rows = jax.vmap(one)(y_true, y_pred, weight)
        counted = weight if row_weight is None else row_weight
        real = jnp.any(counted.reshape(n, -1) != 0, axis=1)  # padding rows: weight 0
        out = {}
        for name, r in zip(self._names, rows):
            spec = self._specs[name]
            if spec.reduction == "sum":
                out[name] = (jnp.tensordot(row_weight, r, axes=1) if row_weight is not None
                             else jnp.sum(r, axis=0)).astype(r.dtype)
            else:
                kept = jnp.where(real.reshape((n,) + (1,) * (r.ndim - 1)), r, jnp.asarray(spec.fill, r.dtype))
                out[name] = (jnp.max if spec.reduction == "max" else jnp.min)(kept, axis=0)
        return out

    #: Keras' own update reads the mask a model's output carries (`update_logs` refuses metrics that do not)
    reads_keras_masks = True

    def _update(self, state: list[Any], y_true: Any, y_pred: Any, sample_weight: Any) -> list[Any]:
        mask = keras_mask(y_pred)
        if mask is not None and sample_weight is not None and jnp.ndim(sample_weight) < jnp.ndim(mask):
            # rows' weights (the padding's among them) beside a mask of their elements, as Keras broadcasts them
            sample_weight = jnp.reshape(sample_weight, jnp.shape(sample_weight) + (1,) * (jnp.ndim(mask) - jnp.ndim(sample_weight)))
        with warnings.catch_warnings(), own_update():  # the padding mask is a float weight; Keras' int counters warn
            warnings.filterwarnings("ignore", message="You are passing weight as `float`")
            weight = {} if sample_weight is None else {"sample_weight": sample_weight}
            return list(self.keras_metric.stateless_update_state(state, y_true, y_pred, **weight))

    def result_from(self, state: State) -> Any:
        return self.keras_metric.stateless_result([state[k] for k in self._names])

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "keras_metric": self.keras_metric.get_config()}


def write_to_keras(metric: Metric, state: State, keras_metric: Any) -> bool:
    """Assigns `metric`'s global (reduced) `state` to the variables of `keras_metric`, the Keras
    object that stands for it: the one it wraps (or a copy), or one whose variables are the state's fields by
    name and shape (a mean's ``total`` and ``count``), so that ``keras_metric.result()`` is the value
    lockstep reported, as Keras' loops leave their metric objects. False where they do not
    correspond (`keras_metric` is left as it is).

    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, lockstep as ls
    >>> k = keras.metrics.Mean()
    >>> write_to_keras(ls.metrics.Mean(), {"total": 6.0, "count": 4.0}, k), float(k.result())
    (True, 1.5)
    """
    variables = list(keras_metric.variables)
    if isinstance(metric, KerasMetric) and metric.built and type(keras_metric) is type(metric.keras_metric) and [
            tuple(v.shape) for v in variables] == [tuple(v.shape) for v in metric.keras_metric.variables]:
        values = [state[name] for name in metric._names]  # the object it wraps, or the one it was copied from
    elif sorted(state) == sorted(v.name for v in variables) and all(
            np.shape(state[v.name]) == tuple(v.shape) for v in variables):
        values = [state[v.name] for v in variables]
    else:
        return False
    for v, value in zip(variables, values):
        v.assign(_placed_as(v, np.asarray(value).astype(v.dtype)))
    return True


def read_from_keras(metric: Metric, keras_metric: Any) -> State | None:
    """The global (reduced) state of `metric` that the variables of `keras_metric` hold: the inverse
    of `write_to_keras` (None where they do not correspond), on the host.

    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, lockstep as ls
    >>> k = keras.metrics.Mean(); k.update_state([1.0, 2.0])
    >>> {name: float(v) for name, v in read_from_keras(ls.metrics.Mean(), k).items()}
    {'total': 3.0, 'count': 2.0}
    """
    variables = list(keras_metric.variables)
    if isinstance(metric, KerasMetric) and metric.built and type(keras_metric) is type(metric.keras_metric) and [
            tuple(v.shape) for v in variables] == [tuple(v.shape) for v in metric.keras_metric.variables]:
        names = list(metric._names)
    elif sorted(metric.state_specs) == sorted(v.name for v in variables) and all(
            metric.state_specs[v.name].shape == tuple(v.shape) for v in variables):
        names = [v.name for v in variables]
    else:
        return None
    return {name: _host_value(v).astype(metric.state_specs[name].dtype) for name, v in zip(names, variables)}


def is_reset(keras_metric: Any) -> bool:
    """Whether `keras_metric`'s variables hold the values its `reset_state()` gives them.

    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras
    >>> k = keras.metrics.Mean(); k.update_state([1.0]); before = is_reset(k); k.reset_state()
    >>> before, is_reset(k)
    (False, True)
    """
    return all(np.array_equal(_host_value(v), np.asarray(value))
               for v, value in zip(keras_metric.variables, keras_metric.stateless_reset_state()))


def _host_value(variable: Any) -> np.ndarray:
    """A metric variable's value on the host (where it spans workers, this worker's copy of it:
    metric variables are replicated)."""
    held = getattr(variable, "_value", None)
    if isinstance(held, jax.Array) and not held.is_fully_addressable:
        return np.asarray(held.addressable_data(0))
    return np.asarray(variable.value)


def reset_keras(keras_metric: Any) -> None:
    """``keras_metric.reset_state()``, its values (Keras' `stateless_reset_state`: a user's
    `reset_state` too) placed as `write_to_keras` places them (no collective).

    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras
    >>> k = keras.metrics.Mean(); k.update_state([1.0, 2.0]); reset_keras(k); float(k.result())
    0.0
    """
    for v, value in zip(keras_metric.variables, keras_metric.stateless_reset_state()):
        if value is not v:  # (a variable its reset leaves as it is)
            v.assign(_placed_as(v, np.asarray(value).astype(v.dtype)))


def _placed_as(variable: Any, value: np.ndarray) -> Any:
    """`value`, which every worker has alike, placed as `variable`'s value lies where that spans
    workers: each worker places its own shards, no collective (Keras' `assign` of a host value
    would take worker 0's, a collective every worker must join: a worker reading its metric
    objects alone would wait for the others); else as it is."""
    held = getattr(variable, "_value", None)
    if isinstance(held, jax.Array) and not held.is_fully_addressable:
        return jax.make_array_from_callback(value.shape, held.sharding, lambda index: value[index])
    return value
