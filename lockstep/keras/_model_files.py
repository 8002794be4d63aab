"""A Keras model's own files as lockstep writes them: `save_model_file` (a `.keras` file of a
trainer's model, its weights and its Keras optimizer's state, as Keras saves them) and
`whole_on_host` (variables whose shards other workers hold gathered first, worker 0 alone
writing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax

from ..checkpoint import BackgroundWriter, atomic_path
from ..engine import host_value, spread


def save_model_file(trainer: Any, path: str, writer: BackgroundWriter | None = None) -> None:
    """Writes `trainer`'s Keras model to the `.keras` file `path` atomically, with the trained
    weights and optimizer state (Keras reads the variables as it writes: always now, after what
    `writer` was given before)."""
    if writer is not None:
        writer.wait()  # files are written in the order they were saved
    trainer.sync_model()  # the weights and the Keras optimizer's state, as Keras saves them
    with whole_on_host(trainer.model) as writes:
        if writes:
            with atomic_path(path) as tmp:
                trainer.model.save(tmp)


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
