"""A model's state layout: `lockstep.sharding`'s layout of a trainer's weights and optimizer state,
given the model's variables, their paths and its optimizer (a Keras optimizer's slots follow the
variable each belongs to), and what it will cost each device before anything is placed
(`memory_estimate`).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from ..distribute import get_strategy
from ..sharding import Replicated, state_layout
from ._model import keras_paths
from ._optimizers import get_optimizer, is_keras_optimizer, keras_slots


def memory_estimate(model: Any, optimizer: Any = "adam", strategy: Any = None) -> dict[str, int]:
    """Bytes of parameters, gradients (in a step) and optimizer state each device of `strategy`
    (default: the active scope's) will hold for `model` (a built Keras model) trained with
    `optimizer` (a name, a Keras optimizer or an optax transformation), worked out before
    anything is placed: DeepSpeed's table. Padded variables (splits that do not divide them)
    count their padded shards; not counted: the model's own Keras variables, which hold such a
    variable without the split that does not divide it.

    >>> import lockstep as ls, keras
    >>> strategy = ls.ShardedStrategy(mesh=ls.DeviceMesh((8, 1), ("batch", "model")), zero_stage=3,
    ...                               min_shard_size=1)
    >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64)])
    >>> ls.memory_estimate(model, "adam", strategy)["parameters"]   # (16 * 64 + 64) * 4 bytes over 8 devices
    544
    """
    engine = (strategy or get_strategy()).extended
    shapes = {"trainable": [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in model.trainable_variables],
              "non_trainable": [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in model.non_trainable_variables]}
    transformation = get_optimizer(optimizer, model.trainable_variables)
    keras_optimizer = optimizer if is_keras_optimizer(optimizer) else None
    return layout_of(engine, transformation, keras_optimizer, model, shapes, keras_paths(model)).estimate(shapes)


def layout_of(engine: Any, optimizer: optax.GradientTransformation, keras_optimizer: Any, model: Any,
              params: Any, paths: Any) -> Replicated:
    """Where a trainer of `model` on `engine` (a strategy's `extended`) keeps `params` (whose paths
    are `paths`) and its optimizer state; `keras_optimizer`: the Keras optimizer it runs, if any."""
    slots = None if keras_optimizer is None else keras_slots(keras_optimizer, model.trainable_variables)
    return state_layout(engine, engine.sharding, optimizer, params, paths, slots)
