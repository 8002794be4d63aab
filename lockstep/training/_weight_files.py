"""`WeightFiles`: `Trainer`'s `save_weights` / `load_weights` / `save`, on its public API only."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..checkpoint import atomic_path, load_tree, save_tree


def _load_weights(path: str, like: Any, opt_state: Any) -> Any:
    """The weights in a `save_weights` file, or in a `save` file (weights beside optimizer state)."""
    try:
        return load_tree(path, like)[0]
    except ValueError:
        return load_tree(path, {"weights": like, "opt_state": opt_state})[0]["weights"]


class WeightFiles:
    """Weight and training-state files for a class with `get_weights`, `set_weights`,
    `train_state` and `model` (the `Trainer`)."""

    model: Any

    def get_weights(self) -> Any:  # pragma: no cover - the Trainer's
        raise NotImplementedError

    def set_weights(self, weights: Any) -> None:  # pragma: no cover - the Trainer's
        raise NotImplementedError

    @property
    def train_state(self) -> Any:  # pragma: no cover - the Trainer's
        raise NotImplementedError

    def sync_model(self) -> None:  # pragma: no cover - the Trainer's
        raise NotImplementedError

    def _opt_state_on_host(self) -> Any:
        return jax.tree.map(np.asarray, self.train_state.opt_state)

    def save_weights(self, path: str) -> None:
        """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them."""
        save_tree(path, self.get_weights())

    def load_weights(self, path: str) -> None:
        """Reads weights written by `save_weights` (or by `save`)."""
        like = self.get_weights()
        self.set_weights(_load_weights(path, like, self._opt_state_on_host()))

    def save(self, path: str, epoch: int | None = None) -> None:
        """Writes the training state atomically: a Keras `.keras` file for a Keras model and a
        `.keras` path; else weights, optimizer state and epoch (`.npz` layout)."""
        weights = self.get_weights()
        if path.endswith(".keras") and hasattr(self.model, "save"):
            self.sync_model()  # the weights and the Keras optimizer's state, as Keras saves them
            with atomic_path(path) as tmp:
                self.model.save(tmp)
            return
        extra = {} if epoch is None else {"epoch": epoch}
        save_tree(path, {"weights": weights, "opt_state": self._opt_state_on_host()}, **extra)
