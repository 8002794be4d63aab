"""A model's state layout: `lockstep.sharding`'s layout of a trainer's weights and optimizer state,
given the model's variables, their paths and its optimizer (a Keras optimizer's slots follow the
variable each belongs to).
"""

from __future__ import annotations

from typing import Any

import optax

from ..sharding import Replicated, state_layout
from ._optimizers import keras_slots


def layout_of(engine: Any, optimizer: optax.GradientTransformation, keras_optimizer: Any, model: Any,
              params: Any, paths: Any) -> Replicated:
    """Where a trainer of `model` on `engine` (a strategy's `extended`) keeps `params` (whose paths
    are `paths`) and its optimizer state; `keras_optimizer`: the Keras optimizer it runs, if any."""
    slots = None if keras_optimizer is None else keras_slots(keras_optimizer, model.trainable_variables)
    return state_layout(engine, engine.sharding, optimizer, params, paths, slots)
