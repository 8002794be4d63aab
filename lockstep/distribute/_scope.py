"""Scopes: which strategy is active, and which were entered lately.

What Keras does inside a scope (its distribution, its `fit`) is `lockstep.keras`'s, which reads the
active scope from here; this module only remembers, on an object made in a scope (a Keras model, a
Keras variable), the scope's strategy (`remember_scope`), as TF's variables hold theirs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from .._errors import UsageError


class Strategy(Protocol):
    """What a scope holds: a strategy (its devices and replica count are read here and by the trainer)."""

    @property
    def devices(self) -> tuple[Any, ...]: ...

    @property
    def num_replicas_in_sync(self) -> int: ...


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[Strategy] = []


_SCOPES = _Scopes()
_RECENT: list[weakref.ReferenceType[Strategy]] = []


@contextlib.contextmanager
def entered(strategy: "Strategy") -> Iterator["Strategy"]:
    """Makes `strategy` the active one (Keras' distribution follows it: `lockstep.keras`)."""
    check_keras_backend()
    keras = sys.modules.get("keras")
    if keras is not None and not getattr(keras, "lockstep_follows_scopes", False):
        import warnings

        warnings.warn(
            "Keras does not follow this lockstep scope: its models would be built, and `model.fit` run, on one "
            "device. Take the strategy from `lockstep` (`ls.MirroredStrategy(...)`), not from a private module, or "
            "call `lockstep.keras.install()` first.", UserWarning, stacklevel=4)
    _SCOPES.stack.append(strategy)
    _RECENT.append(weakref.ref(strategy))
    del _RECENT[:-16]
    try:
        yield strategy
    finally:
        _SCOPES.stack.pop()


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


def strategy_of_model(model: Any, by_devices: bool = True) -> "Strategy | None":
    """The active scope's strategy; else, for a Keras model built (or made: `remember_scope`) in a
    scope, that scope's; else (`by_devices`) a recent scope's whose devices hold the model's
    variables; else None."""
    if active() is not None:
        return active()
    variables = getattr(model, "variables", None) or []
    strategy = getattr(variables[0], _MADE_IN, None) if variables else None
    if strategy is not None or getattr(model, _MADE_IN, None) is not None:
        return strategy or getattr(model, _MADE_IN)
    sharding = getattr(getattr(variables[0], "value", None), "sharding", None) if variables and by_devices else None
    return strategy_of_devices(sharding.device_set) if sharding is not None else None


def check_keras_backend() -> None:
    """Raises when Keras is imported on a backend other than JAX: its models would train outside
    lockstep (each worker its own model) while the strategy reports its replicas.

    Importing lockstep before Keras selects JAX (``KERAS_BACKEND`` defaults to ``"jax"``); this
    catches a Keras imported earlier, or told otherwise.
    """
    keras = sys.modules.get("keras")
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    if backend is not None and backend() != "jax":
        raise UsageError(
            f"Keras runs on the {backend()!r} backend, so a Keras model would train outside lockstep's strategy "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}): set the environment variable KERAS_BACKEND=jax, "
            "or import lockstep before keras (which then selects JAX).")


#: the attribute of a Keras variable made in a lockstep scope that holds the scope's strategy, as
#: TF's variables hold theirs: a model built in `with ls.MirroredStrategy(2).scope():` trains on
#: it after the block, whenever the collector runs (variable and strategy are freed together)
_MADE_IN = "_lockstep_strategy"


def remember_scope(made: Any, strategy: "Strategy | None" = None) -> None:
    """An object made in a lockstep scope (a Keras model, a Keras variable) keeps the scope's
    strategy (`strategy`, else the active scope's), as TF's keep their distribution strategy: a
    subclassed model, whose variables are made when it is first called (often by `fit`, after the
    block), still trains on it (`strategy_of_model`)."""
    strategy = strategy if strategy is not None else active()
    if strategy is not None:
        object.__setattr__(made, _MADE_IN, strategy)
