"""`ProgbarLogger`: a tqdm progress bar with running global metrics (process 0 only)."""

from __future__ import annotations

import sys
from typing import Any

from ._callback import Callback, is_chief


def format_logs(logs: Any) -> str:
    """`logs` as Keras' progress bar shows them; a vector value (say F1 per class) by its mean, as Keras does.

    >>> import numpy as np
    >>> format_logs({"loss": 0.5, "f1_score": np.array([0.25, 0.75]), "note": "x"})
    'loss: 0.5000 - f1_score: 0.5000'
    """
    import numpy as np

    parts = []
    for k, v in logs.items():
        try:
            parts.append(f"{k}: {float(np.mean(np.asarray(v, dtype=np.float64))):.4f}")
        except (TypeError, ValueError):
            continue
    return " - ".join(parts)


class ProgbarLogger(Callback):
    """Shows steps, ETA and the running loss and metrics over all samples seen this epoch.

    `verbose=1`: a bar per epoch, refreshed at most every `refresh_seconds`; `verbose=2`: one
    line per epoch. The running values are global (all replicas, all workers), never an
    average of per-replica values.
    """

    stops_in_batches = False

    def __init__(self, verbose: int = 1, refresh_seconds: float = 0.25, file: Any = None):
        super().__init__()
        self.verbose = verbose
        self.refresh_seconds = refresh_seconds
        self.file = file
        self._bar: Any = None
        self._first = 0  # the first step of the call in progress

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not is_chief() or self.verbose != 1:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=self.params.get("steps"), desc=f"Epoch {epoch + 1}/{self.params.get('epochs', 0)}",
                         unit="step", file=self.file or sys.stdout, mininterval=self.refresh_seconds, leave=True,
                         dynamic_ncols=True)
        self._last = 0.0

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._first = batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._bar is None:
            return
        self._bar.update(batch - self._first + 1)  # the steps of one call (`steps_per_execution`)
        now = self._bar.format_dict.get("elapsed", 0.0)
        if logs is not None and now - self._last >= self.refresh_seconds:
            self._last = now
            self._bar.set_postfix_str(format_logs(logs), refresh=False)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not is_chief():
            return
        if self._bar is not None:
            self._bar.set_postfix_str(format_logs(logs or {}), refresh=True)
            self._bar.close()
            self._bar = None
        elif self.verbose == 2:
            print(f"Epoch {epoch + 1}/{self.params.get('epochs', 0)} - {format_logs(logs or {})}",
                  file=self.file or sys.stdout, flush=True)
