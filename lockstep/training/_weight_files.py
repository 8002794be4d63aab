"""Weight files: the `Trainer`'s `save_weights` / `load_weights` / `save`, on its public API only.

In a job of several workers every worker calls them (a sharded model's weights are gathered from
the workers that hold them) and worker 0 alone writes the file.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from ..checkpoint import BackgroundWriter, load_tree, save_tree
from ..engine import host_value


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
    def weights_to_write(self, opt_state: bool = False, later: bool = True) -> Any: ...
    def set_weights(self, weights: Any) -> None: ...
    def sync_model(self) -> None: ...

    def current_state(self) -> Any: ...


def _opt_state_on_host(trainer: HasWeights) -> Any:
    return jax.tree.map(host_value, trainer.current_state().opt_state)  # (on the host now: no copy needed)


def _write(trainer: HasWeights, writer: BackgroundWriter | None, path: str, opt_state: bool, **extra: Any) -> None:
    """Worker 0 writes the weights (and `opt_state`) to `path`: now, or with `writer` in the
    background, from copies on the devices taken now (`weights_to_write`)."""
    if writer is not None:
        writer.wait()  # (the write before read its copies: one set of them at a time on the devices)
    read = trainer.weights_to_write(opt_state, later=writer is not None)  # (every worker: it may gather)
    if jax.process_index() != 0:
        return
    if writer is None:
        save_tree(path, read(), **extra)
    else:
        writer.submit(lambda: save_tree(path, read(), **extra))


def save_weights(trainer: HasWeights, path: str, writer: BackgroundWriter | None = None) -> None:
    """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them."""
    _write(trainer, writer, path, opt_state=False)


def load_weights(trainer: HasWeights, path: str) -> None:
    """Reads weights written by `save_weights` (or by `save`)."""
    like = trainer.get_weights()
    trainer.set_weights(_load_weights(path, like, _opt_state_on_host(trainer)))


def save(trainer: HasWeights, path: str, epoch: int | None = None, writer: BackgroundWriter | None = None) -> None:
    """Writes the training state atomically: weights, optimizer state and epoch (`.npz` layout)."""
    _write(trainer, writer, path, opt_state=True, **({} if epoch is None else {"epoch": epoch}))


class WeightFiles:
    """The `Trainer`'s weight-file methods (Keras' names), on its public API only."""

    def save_weights(self: HasWeights, path: str, writer: BackgroundWriter | None = None) -> None:
        """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them.
        `writer`: the file is written in the background by it, from copies of the weights made on the
        devices now (`weights_to_write`)."""
        save_weights(self, path, writer)

    def load_weights(self: HasWeights, path: str) -> None:
        """Reads weights written by `save_weights` (or by `save`)."""
        load_weights(self, path)

    def save(self: HasWeights, path: str, epoch: int | None = None, writer: BackgroundWriter | None = None) -> None:
        """Writes the training state atomically: weights, optimizer state and epoch (`.npz` layout;
        `lockstep.Trainer` writes a Keras model to a `.keras` path as a Keras file). `writer`: the
        file is written in the background by it, from copies made on the devices now)."""
        save(self, path, epoch, writer)
