"""What `model.compile(...)` gave a Keras model — optimizer, loss, metrics — taken up by a `Trainer`.

TF users compile in the strategy's scope (seed 004: ``model.compile(optimizer="adam",
loss=..., metrics=["accuracy"])``) and expect training to use exactly that; `Trainer` arguments
left out are read from the compiled model, then fall back to lockstep's defaults.
"""

from __future__ import annotations

from typing import Any

from ..metrics import get as get_metric

DEFAULT_OPTIMIZER = "adam"
DEFAULT_LOSS = "sparse_categorical_crossentropy"


def is_compiled_keras(model: Any) -> bool:
    """Whether `model` is a Keras model on which `compile` was called."""
    return type(model).__module__.startswith("keras") and bool(getattr(model, "compiled", False)) and hasattr(
        model, "get_compile_config")


def settings(model: Any, optimizer: Any, loss: Any, metrics: Any) -> tuple[Any, Any, Any]:
    """(optimizer, loss, metrics): each given one, else the compiled model's, else the default.

    Metrics come from both `metrics` and `weighted_metrics` of `compile` (lockstep weighs every
    metric by `sample_weight`; Keras 3 weighs only `weighted_metrics`).
    """
    if not is_compiled_keras(model):
        return (DEFAULT_OPTIMIZER if optimizer is None else optimizer, DEFAULT_LOSS if loss is None else loss,
                metrics)
    config = model.get_compile_config() or {}
    if optimizer is None:
        optimizer = model.optimizer if model.optimizer is not None else DEFAULT_OPTIMIZER
    if loss is None:
        loss = model.loss if model.loss is not None else DEFAULT_LOSS
        if isinstance(loss, (dict, list, tuple)):
            raise ValueError(
                f"the model was compiled with one loss per output ({type(loss).__name__}); a Trainer trains one "
                "output with one loss: pass `loss=` (a function of the whole y_true and y_pred).")
    if metrics is None:
        metrics = []
        for group, weighted in zip(_given_metrics(model, config), (False, True)):
            for entry in group:
                metric = get_metric(entry)
                metric.weighted = weighted  # Keras weighs only `weighted_metrics` by sample_weight
                metrics.append(metric)
    return optimizer, loss, metrics


def _given_metrics(model: Any, config: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The `metrics` and `weighted_metrics` given to `compile`: the objects as given (their
    arguments kept: an `F1Score(average="macro")` stays macro-averaged, which its serialised
    config may not say), else from the compile config."""
    compiled = getattr(model, "_compile_metrics", None)  # Keras 3's CompileMetrics keeps the user's objects
    if compiled is not None and hasattr(compiled, "_user_metrics"):
        groups = [compiled._user_metrics, compiled._user_weighted_metrics]
    else:
        groups = [config.get("metrics"), config.get("weighted_metrics")]
    out: tuple[list[Any], list[Any]] = ([], [])
    for group, into in zip(groups, out):
        if isinstance(group, dict) or any(isinstance(m, (list, tuple, dict)) and not _serialised(m)
                                          for m in group or []):
            raise ValueError("the model was compiled with metrics per output; pass `metrics=` to the Trainer.")
        into.extend(_metric(m) for m in group or [])
    return out


def _serialised(entry: Any) -> bool:
    return isinstance(entry, dict) and "class_name" in entry


def _metric(entry: Any) -> Any:
    """A compiled metric entry (a name, or a serialised Keras metric) as `Trainer` takes it."""
    if isinstance(entry, dict):
        import keras

        return keras.metrics.deserialize(entry)
    return entry
