"""Updates of objects' state made inside `strategy.run`, carried out of the compiled step.

A TF custom loop updates Keras metrics inside the replica function (``train_accuracy.update_state(
labels, predictions)``). Under JAX that function is traced once and compiled, so it can neither
write a variable nor read one (a value read would be compiled in as a constant). What a replica
contributes is recorded here instead while the function is traced: a target (a callable, say
adding to a Keras metric's variables) and arrays that are the same on every replica (its update,
already reduced over them). `run` returns them beside the function's outputs, and after each call
hands each target its arrays. A function compiled once records once: the targets are kept with it
(`RecordingFunction`) for every later call.

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


def record(target: Any, values: list[Any]) -> None:
    """Records that `target(values)` is called after the call (`values`: arrays the same on every replica)."""
    if not _ACTIVE.stack:
        raise RuntimeError("`record` outside a recorded replica function.")
    _ACTIVE.stack[-1].targets.append(target)
    _ACTIVE.stack[-1].values.append(list(values))


class RecordingFunction:
    """`fn` (a replica function) returning ``(outputs, recorded arrays)``; the targets recorded
    when it was traced are kept on it (`targets`), for `apply` after each call.

    One object per function (`of`), so that the compiled program of `fn` is found again."""

    _made: "dict[int, tuple[Callable[..., Any], RecordingFunction]]" = {}

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.targets: list[Any] = []
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", None)  # type: ignore[assignment]

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> "RecordingFunction":
        held = cls._made.get(id(fn))
        if held is None or held[0] is not fn:
            held = cls._made[id(fn)] = (fn, cls(fn))
            if len(cls._made) > 512:  # the oldest go (a function made anew each step)
                del cls._made[next(iter(cls._made))]
        return held[1]

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, list[list[Any]]]:
        with recording() as updates:
            out = self.fn(*args, **kwargs)
        self.targets = updates.targets
        return out, updates.values

