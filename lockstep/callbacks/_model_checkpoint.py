"""`ModelCheckpoint`: atomic saves of the weights (or the whole training state), written by worker 0,
in the background while training goes on."""

from __future__ import annotations

import os
import string
import warnings
from typing import Any

import numpy as np

from ..checkpoint import BackgroundWriter
from ._monitor import MonitorCallback


class ModelCheckpoint(MonitorCallback):
    """Saves the model at the end of epochs (or every `save_freq` steps).

    Writes are atomic (a temporary file renamed into place), so a crash during a save leaves the
    previous file intact. Only process 0 writes; the decision to save comes from global values.
    With `async_save` (the default) a save copies the weights (and, for a full save, the optimizer
    state) on the devices, and a thread of its own reads the copies to the host and writes the file
    while training goes on. One write is in flight: the next save, the end of `fit` and `wait()`
    wait for it. The step's logs are read (which waits for the step) only where the path names a
    log field or `save_best_only` needs the monitored value. With several workers, arrays whose
    shards other workers hold are gathered to the host at the save. A `.keras` file is written at
    once (Keras reads the model as it writes).

    Args:
      filepath: may hold ``{epoch}`` (1-based, as in Keras) and log fields such as
        ``{val_loss:.4f}``.
      monitor, mode: the log entry and direction for `save_best_only`.
      save_best_only: save only when `monitor` improves.
      save_weights_only: save the weights (`Trainer.load_weights` reads them); else the whole
        training state (weights, optimizer state, epoch) — for a Keras model and a ``.keras``
        path, Keras' own full-model file.
      save_freq: ``"epoch"`` or a number of training steps (with ``steps_per_execution=k``, at the
        end of the call in which a multiple of it is reached, as Keras counts).
      initial_value_threshold: the value to beat first, with `save_best_only`.
      async_save: write `.npz` files in the background (False: each save returns once written).
    """

    stops_in_batches = False

    def __init__(self, filepath: str | os.PathLike[str], monitor: str = "val_loss", verbose: int = 0,
                 save_best_only: bool = False, save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", initial_value_threshold: float | None = None,
                 async_save: bool = True):
        super().__init__(monitor, mode)
        if save_freq != "epoch" and (not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"`save_freq` must be 'epoch' or a positive integer, got save_freq={save_freq!r}.")
        self.filepath = os.fspath(filepath)
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.save_freq = save_freq
        self.initial_value_threshold = initial_value_threshold
        self.best: float | None = initial_value_threshold
        self._steps = 0
        self._first = 0  # the first step of the call in progress
        self._epoch = 0
        self._writer = BackgroundWriter("lockstep-model-checkpoint") if async_save else None

    def wait(self) -> None:
        """Returns when every file saved so far is written; raises the error of a write that failed."""
        if self._writer is not None:
            self._writer.wait()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.wait()

    def on_train_exit(self) -> None:
        """However `fit` ended (an error, an interrupt): the write in flight finishes; its own
        error, if any, is a warning here (`fit`'s error is the one raised)."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 (fit is already ending with its own error)
            warnings.warn(f"ModelCheckpoint: writing a checkpoint failed: {e!r}", RuntimeWarning, stacklevel=2)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._steps = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._first = batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.save_freq == "epoch":
            return
        before, self._steps = self._steps, self._steps + batch - self._first + 1  # a call may take several steps
        if self._steps // int(self.save_freq) > before // int(self.save_freq):
            self._save(self._epoch, {} if logs is None else logs)  # (lazy: read only if the save needs them)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, {} if logs is None else logs)

    def _save(self, epoch: int, logs: dict[str, Any]) -> None:
        assert self.trainer is not None
        if self.save_best_only:
            current = self.get_monitor_value(logs)
            if current is None or not self.is_improvement(current, self.best):
                return
            if self.verbose:
                print(f"Epoch {epoch + 1}: {self.monitor} improved from {self.best} to {current}, saving.")
            self.best = current
        path = self.format_path(epoch, logs)
        # every worker saves (a sharded model's weights are gathered from all), worker 0 alone writes
        if self.save_weights_only:
            self.trainer.save_weights(path, writer=self._writer)
        else:
            self.trainer.save(path, epoch=epoch + 1, writer=self._writer)

    def format_path(self, epoch: int, logs: dict[str, Any]) -> str:
        """`filepath` with the epoch and the log fields it names. The logs are read (all of them,
        waiting for the step) only where it names one."""
        named = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(self.filepath)
                 if name} - {"epoch"}
        fields = {k: float(np.asarray(logs[k])) for k in named if k in logs and np.ndim(logs[k]) == 0}
        try:
            return self.filepath.format(epoch=epoch + 1, **fields)
        except KeyError as e:
            raise KeyError(f"`filepath` {self.filepath!r} names {e}, which is not in the logs "
                           f"({sorted(k for k, v in logs.items() if np.ndim(v) == 0)}).") from None

    def get_state(self) -> dict[str, Any]:
        return {"best": self.best}

    def set_state(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
