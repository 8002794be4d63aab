"""Weight files: the `Trainer`'s `save_weights` / `load_weights` / `save`, on its public API only.

In a job of several workers every worker calls them (a sharded model's weights are gathered from
the workers that hold them) and worker 0 alone writes the file.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import jax

from ..checkpoint import BackgroundWriter, atomic_path, load_tree, save_tree
from ..engine import host_value, spread


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
    return jax.tree.map(host_value, trainer.train_state.opt_state)


def _write_tree(writer: BackgroundWriter | None, path: str, tree: Any, **extra: Any) -> None:
    """Worker 0 writes `tree` (host arrays, its own) to `path`, now or with `writer` in the background."""
    if jax.process_index() != 0:
        return
    if writer is None:
        save_tree(path, tree, **extra)
    else:
        writer.submit(save_tree, path, tree, **extra)


def save_weights(trainer: HasWeights, path: str, writer: BackgroundWriter | None = None) -> None:
    """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them."""
    _write_tree(writer, path, trainer.get_weights())


def load_weights(trainer: HasWeights, path: str) -> None:
    """Reads weights written by `save_weights` (or by `save`)."""
    like = trainer.get_weights()
    trainer.set_weights(_load_weights(path, like, _opt_state_on_host(trainer)))


def save(trainer: HasWeights, path: str, epoch: int | None = None, writer: BackgroundWriter | None = None) -> None:
    """Writes the training state atomically: a Keras `.keras` file for a Keras model and a
    `.keras` path (Keras reads the model's variables as it writes: always now); else weights,
    optimizer state and epoch (`.npz` layout)."""
    if path.endswith(".keras") and hasattr(trainer.model, "save"):
        if writer is not None:
            writer.wait()  # files are written in the order they were saved
        trainer.sync_model()  # the weights and the Keras optimizer's state, as Keras saves them
        with whole_on_host(trainer.model) as writes:
            if writes:
                with atomic_path(path) as tmp:
                    trainer.model.save(tmp)
        return
    extra = {} if epoch is None else {"epoch": epoch}
    _write_tree(writer, path, {"weights": trainer.get_weights(), "opt_state": _opt_state_on_host(trainer)}, **extra)


class _Writing(threading.local):
    def __init__(self) -> None:
        self.depth = 0


_WRITING = _Writing()


def writing() -> bool:
    """Whether a `whole_on_host` block is in progress: the Keras method called there writes as
    its caller decided (worker 0 only), without the workers' barrier of a user's own call."""
    return _WRITING.depth > 0


@contextlib.contextmanager
def whole_on_host(model: Any) -> Iterator[bool]:
    """A Keras model (and its optimizer) whose variables other workers hold shards of keeps each
    one's whole value on this host while Keras writes them (Keras reads variables with NumPy);
    gives whether this worker writes: worker 0 (workers writing one file at once would garble it)."""
    optimizer = getattr(model, "optimizer", None)
    variables = [*model.variables, *(getattr(optimizer, "variables", None) or [])]
    kept = [(v, v._value) for v in variables if spread(getattr(v, "_value", None))]
    whole = [host_value(value) for _, value in kept]  # every worker takes part in gathering them
    _WRITING.depth += 1
    try:
        for (v, _), value in zip(kept, whole):
            v._value = value  # Keras' own slot: `assign` would lay it out over the workers again
        yield jax.process_index() == 0
    finally:
        _WRITING.depth -= 1
        for v, value in kept:
            v._value = value


class WeightFiles:
    """The `Trainer`'s weight-file methods (Keras' names), on its public API only."""

    def save_weights(self: HasWeights, path: str, writer: BackgroundWriter | None = None) -> None:
        """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them.
        `writer`: the file is written in the background by it (the weights are taken now)."""
        save_weights(self, path, writer)

    def load_weights(self: HasWeights, path: str) -> None:
        """Reads weights written by `save_weights` (or by `save`)."""
        load_weights(self, path)

    def save(self: HasWeights, path: str, epoch: int | None = None, writer: BackgroundWriter | None = None) -> None:
        """Writes the training state atomically: a `.keras` file for a Keras model and a `.keras`
        path; else weights, optimizer state and epoch (`.npz` layout). `writer`: an `.npz` file is
        written in the background by it (the state is taken now)."""
        save(self, path, epoch, writer)
