"""`LearningRateScheduler`: set the learning rate at the start of each epoch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._callback import Callback


class LearningRateScheduler(Callback):
    """Calls `schedule(epoch, lr)` at each epoch's start and sets the returned learning rate.

    The optimizer must expose its learning rate: optimizer names (``"adam"``, ...) do; for an
    optax transformation, build it with `optax.inject_hyperparams`.
    """

    stops_in_batches = False

    def __init__(self, schedule: Callable[[int, float], float], verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise TypeError(f"`schedule` must be callable, got {type(schedule).__name__}.")
        self.schedule = schedule
        self.verbose = verbose

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.trainer is not None
        lr = self.schedule(epoch, float(self.trainer.learning_rate))
        if not isinstance(lr, (int, float)):
            raise ValueError(f"`schedule` must return a float, got {lr!r}.")
        self.trainer.learning_rate = float(lr)
        if self.verbose:
            print(f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None and self.trainer is not None:
            logs["learning_rate"] = float(self.trainer.learning_rate)
