"""`ReduceLROnPlateau`: lower the learning rate when a monitored value stops improving."""

from __future__ import annotations

from typing import Any

from ._monitor import MonitorCallback


class ReduceLROnPlateau(MonitorCallback):
    """Multiplies the learning rate by `factor` after `patience` epochs without improvement.

    Keras' arguments and rules; the decision comes from global values, so it is the same on
    every worker.
    """

    stops_in_batches = False

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, verbose: int = 0,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0):
        super().__init__(monitor, mode, min_delta)
        if not 0.0 < factor < 1.0:
            raise ValueError(f"`factor` must be in (0, 1), got factor={factor!r}.")
        self.factor, self.patience, self.verbose = factor, patience, verbose
        self.cooldown, self.min_lr = cooldown, min_lr
        self.wait = 0
        self.cooldown_counter = 0
        self.best: float | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.wait, self.cooldown_counter, self.best = 0, 0, None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.trainer is not None
        if logs is not None:
            logs["learning_rate"] = float(self.trainer.learning_rate)
        current = self.get_monitor_value(logs)
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self.is_improvement(current, self.best):
            self.best = current
            self.wait = 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                old = float(self.trainer.learning_rate)
                if old > self.min_lr:
                    new = max(old * self.factor, self.min_lr)
                    self.trainer.learning_rate = new
                    if self.verbose:
                        print(f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new}.")
                    self.cooldown_counter = self.cooldown
                    self.wait = 0

    def get_state(self) -> dict[str, Any]:
        return {"wait": self.wait, "cooldown_counter": self.cooldown_counter, "best": self.best}

    def set_state(self, state: dict[str, Any]) -> None:
        self.wait, self.cooldown_counter, self.best = state["wait"], state["cooldown_counter"], state["best"]
