"""`lockstep.Trainer`: lockstep's `Trainer` for Keras 3 models as well as `FunctionalModel`s (a
Keras model is driven through `KerasModel`, `_model`; what it trains with may come from its
`compile`, `_compiled`; Keras callbacks run through `_callbacks`; it is saved to a `.keras` path as a Keras file, `_model_files`)."""

from __future__ import annotations

from typing import Any

from .. import training
from ..checkpoint import BackgroundWriter
from ._callbacks import adapt_callback
from ._compiled import compiled_settings
from ._model import KerasModel
from ._model_files import save_model_file


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
    callback_adapter = staticmethod(adapt_callback)

    def save(self, path: str, epoch: int | None = None, writer: BackgroundWriter | None = None) -> None:
        """Writes the training state atomically: a Keras model to a `.keras` path as Keras' own
        `.keras` file (written now: Keras reads the variables as it writes); else as
        `lockstep.training.Trainer.save` does (weights, optimizer state and epoch, `.npz` layout;
        `writer`: in the background)."""
        if path.endswith(".keras") and hasattr(self.model, "save"):
            save_model_file(self, path, writer)
        else:
            super().save(path, epoch, writer)
