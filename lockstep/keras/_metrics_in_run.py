"""Keras metric objects updated inside `strategy.run`, as TF's custom training loops update them.

TF's tutorials create Keras metrics in the strategy's scope and call ``metric.update_state(labels,
predictions)`` inside the replica function, then ``metric.result()`` outside. Here that function
is traced and compiled, and a replica holds padding rows, so a Keras metric (made after lockstep's
strategies were first asked for: `lockstep.keras.install`) updates another way while the function
runs inside `strategy.run`: its update of zeroed variables on the replica's real rows (padding rows weigh 0; a metric that ignores `sample_weight` is updated
row by row, as `KerasMetric` does) is summed over the replicas, carried out of the step, and
added to its variables after each call. `result()` is then what one Keras object computes on the
whole data: exact for metrics that accumulate sums (every Keras metric does). Its stateless face
(``metric.stateless_update_state(variables, ...)`` inside `run`) returns the variables plus that
sum, the same on every replica. Outside `run` the metric is Keras' own.

>>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
'jax'
>>> import keras, numpy as np, lockstep as ls
>>> s = ls.MirroredStrategy(4)
>>> with s.scope():
...     accuracy = keras.metrics.SparseCategoricalAccuracy()
>>> y, p = np.array([0, 1, 1, 0, 1]), np.eye(2)[[0, 1, 0, 0, 0]].astype("float32")   # 3 of 5 right
>>> for batch in s.experimental_distribute_dataset([(y, p)]):
...     _ = s.run(lambda b: accuracy.update_state(b[0], b[1]), args=(batch,))
>>> round(float(accuracy.result()), 6)
0.6
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import UsageError
from ..engine import get_replica_context, is_recording, record
from ..metrics import OWN_UPDATE, KerasMetric, own_update

_ORIGINAL: dict[str, Any] = {}


def install(keras: Any) -> None:
    """Keras metrics made from now on update as this module says inside `strategy.run` (and as
    Keras' own everywhere else): installed once a process by `lockstep.keras.install`, so a metric
    made before lockstep's strategies were first asked for is Keras' own."""
    if _ORIGINAL:
        return
    _ORIGINAL["__init__"] = original = keras.metrics.Metric.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if "update_state" not in self.__dict__:
            object.__setattr__(self, "update_state", functools.partial(_update_state, self, self.update_state))
            object.__setattr__(self, "stateless_update_state",
                               functools.partial(_stateless_update_state, self, self.stateless_update_state))
            object.__setattr__(self, "result", functools.partial(_result, self, self.result))
    keras.metrics.Metric.__init__ = __init__


def _update_state(metric: Any, own: Any, *args: Any, **kwargs: Any) -> Any:
    if OWN_UPDATE.on or get_replica_context() is None or not is_recording():
        return own(*args, **kwargs)
    record(functools.partial(_add, metric), _summed_update(metric, own, args, kwargs))
    return None


def _stateless_update_state(metric: Any, own: Any, metric_variables: Any, *args: Any, **kwargs: Any) -> Any:
    if OWN_UPDATE.on or get_replica_context() is None or not is_recording():
        return own(metric_variables, *args, **kwargs)
    update_state = metric.__dict__["update_state"].args[1]  # the metric's own, which `_update_state` wraps
    return [v + d for v, d in zip(metric_variables, _summed_update(metric, update_state, args, kwargs))]


def _result(metric: Any, own: Any) -> Any:
    if OWN_UPDATE.on or get_replica_context() is None or not is_recording():
        return own()
    raise UsageError(
        f"Keras metric `{metric.name}`'s `result()` (or `metric(...)`, which calls it) was read inside `strategy.run`: "
        "there it would be the value when the step was compiled. Update it inside `run` (`update_state`) and read "
        "`result()` outside, after the call.")


def _add(metric: Any, deltas: list[Any]) -> None:
    """After a call of `run`: the replicas' summed update added to the metric's variables."""
    for v, d in zip(metric.variables, deltas):
        try:
            v.assign(v.value + jnp.asarray(d, v.dtype))
        except ValueError:  # variables the metric shaped on its first update, inside the traced step (an
            v.assign(np.asarray(v.value) + np.asarray(d, v.dtype))  # F1Score's): laid out anew from the host


def _summed_update(metric: Any, update_state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """What the replicas' real rows add to `metric`'s variables (`update_state(*args, **kwargs)`),
    summed over the replicas."""
    ctx = get_replica_context()
    for v in metric.variables:
        if v.aggregation != "sum":
            raise UsageError(
                f"Keras metric `{metric.name}` was updated inside `strategy.run`, but its variable `{v.name}` has "
                f"aggregation={v.aggregation!r}: lockstep adds up the replicas' updates, which is exact only for "
                "variables that accumulate sums. Write it as a lockstep.metrics.Metric (add_state's reduction says "
                "how it combines).")
    args, sample_weight = _without_weight(update_state, args, kwargs)
    weight = _row_weight(metric, ctx, args, sample_weight)
    with own_update(), warnings.catch_warnings():  # the padding mask is a float weight; Keras' int counters warn
        warnings.filterwarnings("ignore", message="You are passing weight as `float`")
        if len(args) == 2 and not kwargs:  # (y_true, y_pred): the Trainer's own wrapper, probes included
            wrapper = _wrapper(metric, args)
            kept = [k for k, spec in wrapper.state_specs.items() if spec.reduction != "sum"]
            if kept:
                raise UsageError(
                    f"Keras metric `{metric.name}` was updated inside `strategy.run`, but its variables {kept} keep "
                    "a maximum or minimum, which lockstep's sum over the replicas would not give. Update it in "
                    "`fit` / `evaluate`, or write it as a lockstep.metrics.Metric (add_state(..., reduction='max')).")
            state = wrapper.batch_state(*args, sample_weight=sample_weight, real=_row_weight(metric, ctx, args, None))
            deltas = [state[k] for k in wrapper._names]
        else:
            zeros = [jnp.zeros(v.shape, v.dtype) for v in metric.variables]
            deltas = list(metric.stateless_update_state(zeros, *args, sample_weight=weight, **kwargs))
    return [ctx.all_reduce("SUM", d) for d in deltas]


def _without_weight(update_state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
    """`args` without the sample weight, wherever it was given (by name, or by its place in the
    metric's `update_state`), and the weight."""
    if "sample_weight" in kwargs:
        return args, kwargs.pop("sample_weight")
    try:
        names = list(inspect.signature(update_state).parameters)
    except (TypeError, ValueError):
        return args, None
    at = names.index("sample_weight") if "sample_weight" in names else len(args)
    return (args[:at] + args[at + 1:], args[at]) if at < len(args) else (args, None)


def _wrapper(metric: Any, args: tuple[Any, ...]) -> KerasMetric:
    """The metric as lockstep's `KerasMetric` (built and probed once, on the rows' shapes)."""
    wrapper = metric.__dict__.get("_lockstep_wrapper")
    if wrapper is None:
        wrapper = KerasMetric(metric)
        object.__setattr__(metric, "_lockstep_wrapper", wrapper)
    if not wrapper.built:
        with jax.ensure_compile_time_eval():  # its variables shaped and probed on made-up rows, not in the trace
            wrapper.build(*(tuple(np.shape(a)) for a in args))
    return wrapper


def _row_weight(metric: Any, ctx: Any, args: tuple[Any, ...], sample_weight: Any) -> Any:
    """Each row's weight: the padding mask times the user's `sample_weight`; a value given for the
    whole replica (a scalar) weighs 1 where the replica holds a real row."""
    mask = ctx.mask
    if mask is None:  # `run` without a distributed batch: every row is real
        return sample_weight
    rows = jnp.shape(args[0])[0] if args and jnp.ndim(args[0]) else None
    if rows is None:
        weight = (jnp.sum(mask) > 0).astype(jnp.float32)
    elif rows == mask.shape[0]:
        weight = mask
    else:
        raise UsageError(
            f"Keras metric `{metric.name}` was updated inside `strategy.run` with {rows} rows, but this replica holds "
            f"{mask.shape[0]} rows of the distributed batch: update it with the batch's rows (or their per-sample "
            "values), whose padding rows lockstep leaves out.")
    if sample_weight is None:
        return weight
    w = jnp.asarray(sample_weight, jnp.float32)
    return w * weight.reshape(weight.shape + (1,) * (w.ndim - weight.ndim)) if w.ndim else w * weight
