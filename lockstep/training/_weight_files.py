"""Weight files: the `Trainer`'s `save_weights` / `load_weights` / `save`, on its public API only."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from ..checkpoint import atomic_path, load_tree, save_tree


def _load_weights(path: str, like: Any, opt_state: Any) -> Any:
    """The weights in a `save_weights` file, or in a `save` file (weights beside optimizer state)."""
    try:
        return load_tree(path, like)[0]
    except ValueError:
        return load_tree(path, {"weights": like, "opt_state": opt_state})[0]["weights"]


class HasWeights(Protocol):
    """What the weight files read and write: the `Trainer`."""

    model: Any

    def get_weights(self) -> Any: ...
    def set_weights(self, weights: Any) -> None: ...
    def sync_model(self) -> None: ...

    @property
    def train_state(self) -> Any: ...


def _opt_state_on_host(trainer: HasWeights) -> Any:
    return jax.tree.map(np.asarray, trainer.train_state.opt_state)


def save_weights(trainer: HasWeights, path: str) -> None:
    """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them."""
    save_tree(path, trainer.get_weights())


def load_weights(trainer: HasWeights, path: str) -> None:
    """Reads weights written by `save_weights` (or by `save`)."""
    like = trainer.get_weights()
    trainer.set_weights(_load_weights(path, like, _opt_state_on_host(trainer)))


def save(trainer: HasWeights, path: str, epoch: int | None = None) -> None:
    """Writes the training state atomically: a Keras `.keras` file for a Keras model and a
    `.keras` path; else weights, optimizer state and epoch (`.npz` layout)."""
    weights = trainer.get_weights()
    if path.endswith(".keras") and hasattr(trainer.model, "save"):
        trainer.sync_model()  # the weights and the Keras optimizer's state, as Keras saves them
        with atomic_path(path) as tmp:
            trainer.model.save(tmp)
        return
    extra = {} if epoch is None else {"epoch": epoch}
    save_tree(path, {"weights": weights, "opt_state": _opt_state_on_host(trainer)}, **extra)


class WeightFiles:
    """The `Trainer`'s weight-file methods (Keras' names), on its public API only."""

    def save_weights(self: HasWeights, path: str) -> None:
        """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them."""
        save_weights(self, path)

    def load_weights(self: HasWeights, path: str) -> None:
        """Reads weights written by `save_weights` (or by `save`)."""
        load_weights(self, path)

    def save(self: HasWeights, path: str, epoch: int | None = None) -> None:
        """Writes the training state atomically: a `.keras` file for a Keras model and a `.keras`
        path; else weights, optimizer state and epoch (`.npz` layout)."""
        save(self, path, epoch)
