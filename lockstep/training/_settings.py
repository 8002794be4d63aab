"""What a `Trainer` trains with, when the arguments leave something out: `ModelSettings` (the
optimizer, loss, metrics and steps per execution given, else lockstep's defaults). A model may
say more of its own training: a compiled Keras model's `compile` (`lockstep.keras`'s Trainer).

>>> given_settings(None, None, None, None, None)[:2]
('adam', 'sparse_categorical_crossentropy')
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

DEFAULT_OPTIMIZER = "adam"
DEFAULT_LOSS = "sparse_categorical_crossentropy"


class ModelSettings(NamedTuple):
    """What a `Trainer` trains with; `loss_scaling`: whether ``mixed_float16`` adds dynamic loss
    scaling (not where Keras' `compile` left it out)."""

    optimizer: Any
    loss: Any
    metrics: Any
    steps_per_execution: int
    loss_scaling: bool = True


def checked_steps_per_execution(given: Any) -> int:
    """`given` as an int.

    Raises:
      ValueError: `given` is not a positive integer.
    """
    if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 1:
        raise ValueError(f"`steps_per_execution` must be a positive integer, got steps_per_execution={given!r}.")
    return int(given)


def given_settings(model: Any, optimizer: Any, loss: Any, metrics: Any, steps_per_execution: Any) -> ModelSettings:
    """The settings given, else lockstep's defaults (a model that says nothing of its training).

    Raises:
      ValueError: `steps_per_execution` is not a positive integer, or `loss` is given per output:
        this model's outputs are not known before it runs.
    """
    steps = checked_steps_per_execution(1 if steps_per_execution is None else steps_per_execution)
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            f"`loss` is given per output ({type(loss).__name__}), but this model's outputs have no names: give one "
            "loss, a function of the whole y_true and y_pred.")
    return ModelSettings(DEFAULT_OPTIMIZER if optimizer is None else optimizer, DEFAULT_LOSS if loss is None else loss,
                         metrics, steps)
