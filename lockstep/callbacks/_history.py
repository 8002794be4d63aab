"""`History`: every epoch's logs, and a plot of the curves."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._callback import Callback


class History(Callback):
    """Records the logs of each epoch; `fit` returns it.

    `history.history` maps each name (``"loss"``, ``"val_accuracy"``, ...) to a list of values,
    one per epoch; `history.epoch` lists the epochs run.
    """

    stops_in_batches = False

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.epoch = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)

    def get_state(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            a = np.asarray(v)
            return float(a) if a.ndim == 0 else a.tolist()
        return {"history": {k: [plain(v) for v in vs] for k, vs in self.history.items()}, "epoch": list(self.epoch)}

    def set_state(self, state: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.epoch = list(state["epoch"])

    def plot(self, path: str | os.PathLike[str], keys: list[str] | None = None) -> str:
        """Writes a PNG of the curves (train next to validation) to `path`; returns the path.

        Raises:
          ValueError: nothing recorded yet, or `keys` names a missing entry.
        """
        from .._optional import require

        matplotlib = require("matplotlib", "plot", "`History.plot`")
        matplotlib.use("Agg", force=False)
        plt = require("matplotlib.pyplot", "plot", "`History.plot`")

        from ..checkpoint import atomic_path

        if not self.history:
            raise ValueError("`History.plot` needs at least one finished epoch; the history is empty.")
        scalar = [k for k, v in self.history.items() if np.ndim(v[0]) == 0]
        keys = keys or [k for k in scalar if not k.startswith("val_")]
        missing = [k for k in keys if k not in self.history]
        if missing:
            raise ValueError(f"`keys` names entries not in the history: {missing}; it has {sorted(self.history)}.")
        fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
        epochs = [e + 1 for e in self.epoch] or list(range(1, len(self.history[keys[0]]) + 1))
        for ax, key in zip(axes[0], keys):
            ax.plot(epochs, self.history[key], marker="o", label=key)
            if f"val_{key}" in self.history:
                ax.plot(epochs, self.history[f"val_{key}"], marker="o", label=f"val_{key}")
            ax.set_xlabel("epoch")
            ax.set_title(key)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        return os.fspath(path)
