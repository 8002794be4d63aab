"""`TerminateOnNaN`: stop when the running loss becomes NaN or infinite."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._callback import Callback


class TerminateOnNaN(Callback):
    """Stops training when the (global, running) loss is NaN or infinite.

    Checked at every epoch end, and at every batch end when `check_every_batch` is true (which
    reads the running loss each step: one small synchronisation per step).
    """

    def __init__(self, check_every_batch: bool = True):
        super().__init__()
        self.check_every_batch = check_every_batch
        self.terminated_at: tuple[int, int | None] | None = None
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.terminated_at = None

    def _check(self, logs: Any, batch: int | None) -> None:
        if self.terminated_at is not None:
            return
        loss = None if logs is None else logs.get("loss")
        if loss is not None and not np.isfinite(float(np.asarray(loss))):
            print(f"Batch {batch}: invalid loss, terminating training" if batch is not None
                  else f"Epoch {self._epoch + 1}: invalid loss, terminating training")
            self.terminated_at = (self._epoch, batch)
            assert self.trainer is not None
            self.trainer.stop_training = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.check_every_batch:
            self._check(logs, batch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._check(logs, None)
