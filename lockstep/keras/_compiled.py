"""What `model.compile(...)` gave a Keras model — optimizer, loss, metrics, steps per execution —
taken up by a `Trainer` (`compiled_settings`, the Keras Trainer's `model_settings`), and a Keras
model's losses and metrics per output.

TF users compile in the strategy's scope (seed 004: ``model.compile(optimizer="adam",
loss=..., metrics=["accuracy"])``) and expect training to use exactly that; `Trainer` arguments
left out are read from the compiled model, then fall back to lockstep's defaults.
"""

from __future__ import annotations

from typing import Any

from .. import losses as _losses
from .._keras_kind import is_keras
from ..metrics import get as get_metric
from ..training import (DEFAULT_LOSS, DEFAULT_OPTIMIZER, ModelSettings, Outputs, checked_steps_per_execution,
                        keras_metric_names, loss_weight, output_settings)
from ._optimizer import is_loss_scaled


def no_loss(y_true: Any, y_pred: Any) -> Any:
    """The loss of a Keras model compiled without one: 0 for each sample (Keras then trains on
    the layers' `add_loss` terms alone, which the step adds as it adds every model's)."""
    import jax
    import jax.numpy as jnp

    return jnp.zeros(jax.tree.leaves(y_pred)[0].shape[:1], jnp.float32)


def is_compiled_keras(model: Any) -> bool:
    """Whether `model` is a Keras model on which `compile` was called."""
    return is_keras(model) and bool(getattr(model, "compiled", False)) and hasattr(
        model, "get_compile_config")


def compiled_settings(model: Any, optimizer: Any, loss: Any, metrics: Any, steps_per_execution: Any) -> ModelSettings:
    """`settings`, and `steps_per_execution` given (a positive integer), else a compiled Keras
    model's, else 1; loss scaling under ``mixed_float16`` unless Keras' `compile` left it out (the
    optimizer, `compile`'s, not a `LossScaleOptimizer`).

    Raises:
      ValueError: `steps_per_execution` (or the compiled one) is not a positive integer.
    """
    compiled = is_compiled_keras(model)
    if steps_per_execution is None:
        steps_per_execution = getattr(model, "steps_per_execution", 1) if compiled else 1
    steps = checked_steps_per_execution(steps_per_execution)
    from_compile = optimizer is None and compiled  # the optimizer is model.compile's
    optimizer, loss, metrics = settings(model, optimizer, loss, metrics, compiled)
    return ModelSettings(optimizer, loss, metrics, steps, not (from_compile and not is_loss_scaled(optimizer)))


def settings(model: Any, optimizer: Any, loss: Any, metrics: Any, compiled: bool) -> tuple[Any, Any, Any]:
    """(optimizer, loss, metrics): each given one, else the compiled model's (`compiled`: `compile`
    was called on `model`), else the default.

    Metrics come from both `metrics` and `weighted_metrics` of `compile` (as in Keras 3, only the
    latter are weighted by `sample_weight`). A model with several outputs, or a loss given per
    output, gets a `_outputs.OutputLosses` and metrics per output; a single output's
    `loss_weights` scale its loss.
    """
    loss_weights = None
    if compiled:
        if optimizer is None:
            optimizer = model.optimizer if model.optimizer is not None else DEFAULT_OPTIMIZER
        if loss is None:
            loss = model.loss if getattr(model, "_compile_loss", None) is not None else no_loss
            loss_weights = _loss_weights(model)
    optimizer = DEFAULT_OPTIMIZER if optimizer is None else optimizer
    loss = DEFAULT_LOSS if loss is None else loss
    names = _output_names(model)
    if loss is no_loss and names is not None and len(names) > 1:
        raise ValueError(f"the model was compiled without a loss (Keras then trains on its layers' `add_loss` "
                         f"terms alone), and it has {len(names)} outputs: lockstep takes that only for a model of "
                         "one output; give `compile` a loss per output (0 for none) or train on one output.")
    if names is None and isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            f"`loss` is given per output ({type(loss).__name__}), but the model's outputs are not known before it "
            "runs (a subclassed model): give one loss, a function of the whole y_true and y_pred, or build the model "
            "with the functional API.")
    if names is not None and (len(names) > 1 or isinstance(loss, (dict, list, tuple))):
        outputs = Outputs(names)
        if len(names) > 1:
            groups: list[Any] = [(metrics, None)] if metrics is not None else []
            if metrics is None and compiled:  # Keras weighs only `weighted_metrics` by sample_weight
                groups = list(zip(_given_metrics(model, per_output=True), (False, True)))
            return (optimizer, *output_settings(outputs, loss, loss_weights, groups))
        loss = next(iter(_per_output(loss, outputs).values()))  # one output: its loss (and weight)
        loss_weights = None if loss_weights is None else next(iter(_per_output(loss_weights, outputs).values()))
    if isinstance(loss_weights, (list, tuple, dict)) and len(loss_weights) == 1:  # one output's, as Keras takes it
        loss_weights = next(iter(loss_weights.values() if isinstance(loss_weights, dict) else loss_weights))
    if loss_weights is not None and loss_weights != 1:
        loss = _scaled(_losses.get(loss), loss_weights, loss)
    if metrics is None and compiled:
        metrics = []
        for group, weighted in zip(_given_metrics(model), (False, True)):
            for entry in group:
                metric = get_metric(entry)
                metric.weighted = weighted  # Keras weighs only `weighted_metrics` by sample_weight
                metrics.append(metric)
        for metric, name in zip(metrics, keras_metric_names(("", m.name, m.weighted) for m in metrics)):
            metric.name = name  # Keras' names of repeated ones (`weighted_mse`, `mae_1`)
    return optimizer, loss, metrics


def _output_names(model: Any) -> list[str] | None:
    """A Keras model's output names when its outputs are known (a functional or sequential model), else None."""
    if not type(model).__module__.startswith("keras") and not hasattr(model, "output_names"):
        return None
    try:
        outputs = getattr(model, "outputs", None)
        names = getattr(model, "output_names", None)
    except (AttributeError, ValueError):
        return None
    if not outputs or not names or len(names) != len(outputs):
        return None
    return list(names)


def _per_output(spec: Any, outputs: Outputs) -> dict[str, Any]:
    if isinstance(spec, (dict, list, tuple)):
        return outputs.named(spec, "loss")
    return {outputs.names[0]: spec}


def _loss_weights(model: Any) -> Any:
    """`compile`'s `loss_weights` (None when not given)."""
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is not None and hasattr(compile_loss, "_user_loss_weights"):
        return compile_loss._user_loss_weights
    return (model.get_compile_config() or {}).get("loss_weights")


def _scaled(fn: Any, weight: Any, loss: Any) -> Any:
    """`fn` (a per-sample loss) times a single output's `loss_weights` entry."""
    weight = loss_weight(weight)

    def scaled(y_true: Any, y_pred: Any, *sample_weight: Any) -> Any:  # (the weights where `fn` takes them)
        return fn(y_true, y_pred, *sample_weight) * weight
    scaled.name = getattr(fn, "name", None) or (loss if isinstance(loss, str) else "loss")  # type: ignore[attr-defined]
    scaled.takes_sample_weight = getattr(fn, "takes_sample_weight", False)  # type: ignore[attr-defined]
    return scaled


def _given_metrics(model: Any, per_output: bool = False) -> Any:
    """The `metrics` and `weighted_metrics` given to `compile`: the objects as given (their
    arguments kept: an `F1Score(average="macro")` stays macro-averaged, which its serialised
    config may not say), else from the compile config; as given when `per_output`."""
    compiled = getattr(model, "_compile_metrics", None)  # Keras 3's CompileMetrics keeps the user's objects
    if compiled is not None and hasattr(compiled, "_user_metrics"):
        groups = [compiled._user_metrics, compiled._user_weighted_metrics]
    elif compiled is None and hasattr(model, "_compile_metrics"):  # Keras 3 compiled without metrics: none given
        groups = [None, None]  # (the compile config would be serialised: Keras imports TensorFlow for that, 3 s)
    else:
        config = model.get_compile_config() or {}
        groups = [config.get("metrics"), config.get("weighted_metrics")]
    if per_output:
        return groups
    out: tuple[list[Any], list[Any]] = ([], [])
    for group, into in zip(groups, out):
        if isinstance(group, dict) or any(isinstance(m, (list, tuple, dict)) and not _serialised(m)
                                          for m in group or []):
            raise ValueError(f"the model has one output but was compiled with metrics per output ({group!r}): "
                             "give a list of metrics.")
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
