"""`TensorBoard`: scalar curves in TensorBoard's event-file format (via tensorboardX), chief only."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._callback import Callback, is_chief


class TensorBoard(Callback):
    """Writes each epoch's scalar logs under `log_dir/train` and `log_dir/validation`.

    Args:
      log_dir: where the event files go.
      update_freq: ``"epoch"``, or a number of steps between writes of the running training values.
    """

    stops_in_batches = False

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: str | int = "epoch"):
        super().__init__()
        if update_freq != "epoch" and (not isinstance(update_freq, int) or update_freq < 1):
            raise ValueError(f"`update_freq` must be 'epoch' or a positive integer, got {update_freq!r}.")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writers: dict[str, Any] = {}
        self._step = 0
        self._first = 0  # the first step of the call in progress

    def _writer(self, kind: str) -> Any:
        if kind not in self._writers:
            from .._optional import require

            tensorboardx = require("tensorboardX", "tensorboard", "the `TensorBoard` callback")
            self._writers[kind] = tensorboardx.SummaryWriter(os.path.join(self.log_dir, kind))
        return self._writers[kind]

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._first = batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        before, self._step = self._step, self._step + batch - self._first + 1  # a call's steps (`steps_per_execution`)
        if (self.update_freq == "epoch" or not is_chief()
                or self._step // int(self.update_freq) == before // int(self.update_freq)):
            return
        for k, v in (logs or {}).items():
            if np.ndim(v) == 0:
                self._writer("train").add_scalar(f"batch_{k}", float(v), self._step)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not is_chief():
            return
        for k, v in (logs or {}).items():
            if np.ndim(v) != 0:
                continue
            kind, name = ("validation", k[4:]) if k.startswith("val_") else ("train", k)
            self._writer(kind).add_scalar(f"epoch_{name}", float(v), epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_exit(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers = {}
