"""`CSVLogger`: one CSV row per epoch (chief only)."""

from __future__ import annotations

import csv
import os
from typing import Any

import numpy as np

from ._callback import Callback, is_chief


class CSVLogger(Callback):
    """Streams each epoch's logs to a CSV file, as Keras' `CSVLogger`.

    Args:
      filename: the CSV path.
      separator: the field separator.
      append: add to an existing file instead of overwriting it.
    """

    stops_in_batches = False

    def __init__(self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False):
        super().__init__()
        self.filename = os.fspath(filename)
        self.sep = separator
        self.append = append
        self._keys: list[str] | None = None
        self._file: Any = None
        self._writer: Any = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not is_chief():
            return
        exists = self.append and os.path.exists(self.filename) and os.path.getsize(self.filename) > 0
        self._file = open(self.filename, "a" if self.append else "w", newline="")
        self._keys = None
        self._has_header = exists

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._file is None:
            return
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs)
            self._writer = csv.DictWriter(self._file, fieldnames=["epoch", *self._keys], delimiter=self.sep)
            if not self._has_header:
                self._writer.writeheader()

        def fmt(v: Any) -> Any:
            a = np.asarray(v)
            return float(a) if a.ndim == 0 else f"[{' '.join(str(x) for x in a.ravel())}]"
        self._writer.writerow({"epoch": epoch, **{k: fmt(logs.get(k, "NA")) if k in logs else "NA"
                                                   for k in self._keys}})
        self._file.flush()

    def on_train_exit(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
