"""Scopes: which strategy is active, which were entered lately, and Keras' distribution inside them.

A Keras 3 model built inside `strategy.scope()` gets its variables replicated on the strategy's
devices because Keras' own `DataParallel` distribution is set for the duration of the scope.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ._errors import UsageError

if TYPE_CHECKING:
    from ._strategy import Strategy


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[Strategy] = []


_SCOPES = _Scopes()
_RECENT: list[weakref.ReferenceType[Strategy]] = []
_NO_KERAS = object()


@contextlib.contextmanager
def entered(strategy: "Strategy") -> Iterator["Strategy"]:
    """Makes `strategy` the active one (and Keras' distribution data-parallel over its devices)."""
    _SCOPES.stack.append(strategy)
    _RECENT.append(weakref.ref(strategy))
    del _RECENT[:-16]
    previous = _enter_keras_distribution(strategy.devices)
    try:
        yield strategy
    finally:
        _SCOPES.stack.pop()
        _exit_keras_distribution(previous)


def active() -> "Strategy | None":
    """The strategy of the innermost active scope in this thread, else None."""
    return _SCOPES.stack[-1] if _SCOPES.stack else None


def recent() -> list["Strategy"]:
    """Strategies whose scope was entered lately (newest last) and that are still alive."""
    return [s for s in (ref() for ref in _RECENT) if s is not None]


def strategy_of_devices(devices: Iterable[Any]) -> "Strategy | None":
    """The most recently entered scope's strategy whose devices are exactly `devices`."""
    wanted = set(devices)
    for strategy in reversed(recent()):
        if set(strategy.devices) == wanted:
            return strategy
    return None


def _enter_keras_distribution(devices: Iterable[Any]) -> Any:
    """Sets Keras' distribution to data parallelism over `devices` (only when Keras, on the JAX
    backend, is imported or asked for); returns the previous one."""
    keras = sys.modules.get("keras")
    if keras is None and os.environ.get("KERAS_BACKEND") == "jax":
        import keras  # the user asked for Keras on JAX: models may be built inside this scope
    if keras is None or keras.backend.backend() != "jax":
        return _NO_KERAS
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(_keras_data_parallel(keras)(devices=list(devices)))
    return previous


_CLASSES: dict[int, type] = {}


def _keras_data_parallel(keras: Any) -> type:
    """Keras' `DataParallel`, except that Keras' own training loops refuse to run under it: they
    would split batches Keras' way (`IndivisibleError` on a short last batch, per-replica
    statistics), not lockstep's."""
    cls = _CLASSES.get(id(keras))
    if cls is None:
        class LockstepDataParallel(keras.distribution.DataParallel):  # type: ignore[misc, name-defined]
            def get_data_layout(self, data_shape: Any) -> Any:  # only Keras' fit/evaluate/predict ask
                raise UsageError(
                    "Keras' own `model.fit` / `evaluate` / `predict` was called inside a lockstep "
                    "`strategy.scope()`. Train with `ls.Trainer(model).fit(...)` (it takes the compiled "
                    "optimizer, loss and metrics, and is exact for any batch size), or call Keras' methods "
                    "outside the scope.")
        cls = _CLASSES[id(keras)] = LockstepDataParallel
    return cls


def foreign_keras_distribution() -> Any:
    """The active Keras distribution when it is not the one a lockstep scope sets, else None."""
    keras = sys.modules.get("keras")
    if keras is None or keras.backend.backend() != "jax":
        return None
    current = keras.distribution.distribution()
    return None if current is None or type(current) is _CLASSES.get(id(keras)) else current


def _exit_keras_distribution(previous: Any) -> None:
    if previous is not _NO_KERAS:
        sys.modules["keras"].distribution.set_distribution(previous)
