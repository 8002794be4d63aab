"""`lockstep.Trainer`: lockstep's `Trainer` for Keras 3 models as well as `FunctionalModel`s (a
Keras model is driven through `KerasModel`, `_model`; what it trains with may come from its
`compile`, `_compiled`)."""

from __future__ import annotations

from typing import Any

from .. import training
from ._compiled import compiled_settings
from ._model import KerasModel


def _adapt(model: Any, seed: int = 0, batch_statistics: str = "global") -> Any:
    """The adapter for `model`: a Keras 3 model's `KerasModel`, else `lockstep.training`'s."""
    import keras

    if isinstance(model, keras.Model):
        return KerasModel(model, batch_statistics)
    if isinstance(model, training.FunctionalModel):
        return training.Trainer.model_adapter(model, seed, batch_statistics)
    raise TypeError(f"`model` must be a Keras 3 model or a lockstep.FunctionalModel, got {type(model).__name__}.")


class Trainer(training.Trainer):
    __doc__ = training.Trainer.__doc__
    model_adapter = staticmethod(_adapt)
    model_settings = staticmethod(compiled_settings)
