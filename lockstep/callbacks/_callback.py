"""`Callback`: Keras' hook names and arguments, on a trainer seen through `TrainerView`."""

from __future__ import annotations

from typing import Any

import jax

from ._trainer_view import TrainerView


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

    #: whether a hook other than `on_epoch_end` / `on_train_end` may set `trainer.stop_training`
    #: (a user's may: then, where it overrides one, every worker agrees after each call of steps,
    #: and stops where any worker's callback asked); lockstep's own say where theirs do
    stops_in_batches = True

    def __init__(self) -> None:
        self.trainer: TrainerView | None = None
        #: what `fit` gives every callback, as Keras does: ``{"verbose": ..., "epochs": ..., "steps": ...}``
        self.params: dict[str, Any] = {}

    @property
    def model(self) -> TrainerView | None:
        return self.trainer

    def set_trainer(self, trainer: TrainerView) -> None:
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


#: Keras' hook names
HOOKS = [name for name in vars(Callback) if name.startswith("on_")]
