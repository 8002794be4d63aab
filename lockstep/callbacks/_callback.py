"""`Callback` (Keras' hook names) and `CallbackList`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from ..training._trainer import Trainer


def is_chief() -> bool:
    """Whether this process writes files and prints (process 0)."""
    return jax.process_index() == 0


class Callback:
    """Base class of callbacks; override the hooks you need (Keras' names and arguments).

    `self.trainer` (also `self.model`, as in Keras) is the `Trainer` being run. Decisions
    (`trainer.stop_training = True`, a new learning rate) must come from the `logs`, which hold
    global values identical on every worker, so every worker decides the same.

    >>> import lockstep as ls
    >>> class PrintEpoch(ls.callbacks.Callback):
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         print(epoch, sorted(logs))
    """

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        #: what `fit` gives every callback, as Keras does: ``{"verbose": ..., "epochs": ..., "steps": ...}``
        self.params: dict[str, Any] = {}

    @property
    def model(self) -> "Trainer | None":
        return self.trainer

    def set_trainer(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Any = None) -> None: ...
    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Any = None) -> None: ...
    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Any = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Any = None) -> None: ...

    def on_train_exit(self) -> None:
        """Called when `fit` ends by any path: after `on_train_end`, or after an exception (a
        `KeyboardInterrupt`, a failing callback), when `on_train_end` is not called. Release here
        what `on_train_begin` took (signal handlers, open files); not a Keras hook."""

    def get_state(self) -> dict[str, Any]:
        """The callback's bookkeeping, to be checkpointed (see `set_state`)."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores what `get_state` returned."""


_HOOKS = [name for name in vars(Callback) if name.startswith("on_")]


class CallbackList:
    """Calls every hook on every callback, in order (callbacks marked `runs_last`, the backups, last)."""

    def __init__(self, callbacks: Iterable[Callback], trainer: "Trainer", params: dict[str, Any] | None = None):
        from ._keras_callback import KerasCallback, is_keras_callback  # it builds on Callback

        self.callbacks = [KerasCallback(cb) if is_keras_callback(cb) else cb for cb in callbacks]
        # those that back up the training state last, so the backup holds what the others did at that step
        self.callbacks.sort(key=lambda cb: bool(getattr(cb, "runs_last", False)))
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"`callbacks` must hold lockstep or Keras callback objects, got {type(cb).__name__}.")
            cb.set_trainer(trainer)
            if params is not None:
                cb.set_params(params)

    def __getattr__(self, name: str) -> Any:
        if name not in _HOOKS:
            raise AttributeError(name)
        # the hooks some callback overrides, bound once (a hook runs every step: keep it cheap)
        bound = [getattr(cb, name) for cb in self.callbacks
                 if getattr(type(cb), name) is not getattr(Callback, name) or name in vars(cb)]

        def call(*args: Any, **kwargs: Any) -> None:
            for hook in bound:
                hook(*args, **kwargs)
        setattr(self, name, call)  # later lookups find the attribute and skip __getattr__
        return call
