"""Optimizer names resolved to optax, with the learning rate exposed for callbacks."""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

# name -> (optax factory, Keras' default learning rate, Keras-like defaults)
_OPTIMIZERS: dict[str, tuple[Any, float, dict[str, Any]]] = {
    "adam": (optax.adam, 1e-3, {"eps": 1e-7}),
    "adamw": (optax.adamw, 1e-3, {"eps": 1e-7, "weight_decay": 0.004}),
    "sgd": (optax.sgd, 1e-2, {}),
    "rmsprop": (optax.rmsprop, 1e-3, {"decay": 0.9, "eps": 1e-7}),
}


def get_optimizer(optimizer: str | optax.GradientTransformation) -> optax.GradientTransformation:
    """An optax transformation from a name (``"adam"``, ``"adamw"``, ``"sgd"``, ``"rmsprop"``) or as given.

    Named optimizers are built with `optax.inject_hyperparams`, so `Trainer.learning_rate` can be
    read and changed (LearningRateScheduler, ReduceLROnPlateau) without recompiling.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
      TypeError: neither a name nor an optax transformation.
    """
    if isinstance(optimizer, str):
        entry = _OPTIMIZERS.get(optimizer.lower())
        if entry is None:
            raise ValueError(f"`optimizer` must be an optax transformation or one of {sorted(_OPTIMIZERS)}, "
                             f"got optimizer={optimizer!r}.")
        factory, lr, kwargs = entry
        return optax.inject_hyperparams(factory)(learning_rate=lr, **kwargs)
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    raise TypeError(f"`optimizer` must be a name or an optax.GradientTransformation, got {type(optimizer).__name__}.")


def find_hyperparams(opt_state: Any) -> dict[str, Any] | None:
    """The `hyperparams` dict of an `inject_hyperparams` state inside `opt_state`, if any."""
    stack = [opt_state]
    while stack:
        node = stack.pop()
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, dict) and "learning_rate" in hp:
            return hp
        if isinstance(node, (tuple, list)):
            stack.extend(node)
    return None


def _hyperparams(opt_state: Any) -> dict[str, Any]:
    hp = find_hyperparams(opt_state)
    if hp is None:
        raise ValueError("the optimizer does not expose its learning rate: use a name such as 'adam', or build "
                         "it with `optax.inject_hyperparams`.")
    return hp


def learning_rate_of(opt_state: Any) -> Any:
    """The learning rate held in `opt_state` (an `inject_hyperparams` state)."""
    return _hyperparams(opt_state)["learning_rate"]


def set_learning_rate(opt_state: Any, value: float, place: Any) -> None:
    """Sets the learning rate inside `opt_state` in place (same dtype, placed by `place`), so the
    compiled step is reused."""
    hp = _hyperparams(opt_state)
    hp["learning_rate"] = place(np.asarray(value, dtype=np.asarray(hp["learning_rate"]).dtype))
