"""Updates of objects' state made inside `strategy.run`, carried out of the compiled step.

A TF custom loop updates Keras metrics inside the replica function (``train_accuracy.update_state(
labels, predictions)``). Under JAX that function is traced once and compiled, so it can neither
write a variable nor read one (a value read would be compiled in as a constant). What a replica
contributes is recorded here instead while the function is traced: a target (a callable, say
adding to a Keras metric's variables) and arrays that are the same on every replica (its update,
already reduced over them). `RecordingFunction` returns them beside the function's outputs as a
`Recorded` value, a pytree whose structure holds the targets, so each compiled program of the
function hands its own targets its own arrays after every call (`Recorded.apply`).

>>> with recording() as updates:
...     record("target", [1.0])
>>> updates.targets, updates.values
(['target'], [[1.0]])
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax


class StateUpdates:
    """What one traced call of a replica function recorded: targets and their arrays, in order."""

    def __init__(self) -> None:
        self.targets: list[Any] = []
        self.values: list[list[Any]] = []


class _Active(threading.local):
    def __init__(self) -> None:
        self.stack: list[StateUpdates] = []


_ACTIVE = _Active()


@contextlib.contextmanager
def recording() -> Iterator[StateUpdates]:
    """Records the state updates made while the block runs (a replica function being traced)."""
    updates = StateUpdates()
    _ACTIVE.stack.append(updates)
    try:
        yield updates
    finally:
        _ACTIVE.stack.pop()


def is_recording() -> bool:
    """Whether a replica function of `strategy.run` is being traced, whose state updates are recorded."""
    return bool(_ACTIVE.stack)


def record(target: Callable[[list[Any]], None], values: list[Any]) -> None:
    """Records that `target(values)` is called after the call (`values`: arrays the same on every replica)."""
    if not _ACTIVE.stack:
        raise RuntimeError("`record` outside a recorded replica function.")
    _ACTIVE.stack[-1].targets.append(target)
    _ACTIVE.stack[-1].values.append(list(values))


class Recorded:
    """The arrays a traced call recorded, with their targets as the pytree's static part: the
    compiled program's output structure keeps the targets of its own trace."""

    def __init__(self, targets: tuple[Any, ...], values: list[list[Any]]):
        self.targets = targets
        self.values = values

    def apply(self) -> None:
        """Hands each target its arrays (after a call)."""
        for target, arrays in zip(self.targets, self.values):
            target(arrays)


jax.tree_util.register_pytree_node(Recorded, lambda r: (r.values, r.targets), lambda targets, values: Recorded(
    targets, values))


class RecordingFunction:
    """`fn` (a replica function) returning ``(outputs, Recorded)``. Equal to another made of an
    equal function (a bound method accessed anew, say), so the compiled program of `fn` is found
    again."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", None)  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordingFunction) and self.fn == other.fn

    def __hash__(self) -> int:
        return hash(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Recorded]:
        with recording() as updates:
            out = self.fn(*args, **kwargs)
        return out, Recorded(tuple(updates.targets), updates.values)
