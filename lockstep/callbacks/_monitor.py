"""The monitor / mode / min_delta logic that `EarlyStopping`, `ModelCheckpoint` and
`ReduceLROnPlateau` share (as in Keras' `MonitorCallback`)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ._callback import Callback

_MODES = ("auto", "min", "max")


class MonitorCallback(Callback):
    """Watches one entry of the epoch logs and says whether a value improves on a reference."""

    def __init__(self, monitor: str = "val_loss", mode: str = "auto", min_delta: float = 0.0):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"`mode` must be one of {_MODES}, got mode={mode!r}.")
        if not isinstance(monitor, str):
            raise TypeError(f"`monitor` must be a string naming a log entry, got monitor={monitor!r}.")
        self.monitor = monitor
        self.mode = mode
        self.min_delta = abs(float(min_delta))
        self._direction: str | None = None
        self._warned = False

    def _resolve_direction(self) -> str:
        if self._direction is not None:
            return self._direction
        if self.mode in ("min", "max"):
            self._direction = self.mode
            return self._direction
        name = self.monitor.removeprefix("val_")
        if name == "loss":
            self._direction = "min"
            return self._direction
        metric = self.trainer.get_metric(name) if self.trainer is not None else None
        direction = getattr(metric, "direction", None)
        if direction is None:
            raise ValueError(
                f"{type(self).__name__} cannot tell whether `{self.monitor}` should go up or down: "
                "pass mode='max' or mode='min'."
            )
        self._direction = "max" if direction == "up" else "min"
        return self._direction

    def is_improvement(self, value: float, reference: float | None) -> bool:
        direction = self._resolve_direction()  # first, so an undirected monitor fails at once
        if reference is None:
            return True
        if direction == "min":
            return bool(value + self.min_delta < reference)
        return bool(value - self.min_delta > reference)

    def get_monitor_value(self, logs: dict[str, Any] | None) -> float | None:
        logs = logs or {}
        value = logs.get(self.monitor)
        if value is None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"{type(self).__name__} is conditioned on `{self.monitor}`, which is not in the logs. "
                    f"Available: {', '.join(sorted(logs))}.", stacklevel=3)
            return None
        value = np.asarray(value)
        if value.ndim:
            raise ValueError(f"`monitor={self.monitor!r}` must name a scalar log entry, got shape {value.shape}.")
        return float(value)
