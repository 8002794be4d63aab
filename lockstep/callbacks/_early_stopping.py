"""`EarlyStopping`: Keras' rules, decided from global values, so every worker stops together."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ._monitor import MonitorCallback


@dataclasses.dataclass
class EarlyStoppingState:
    """EarlyStopping's bookkeeping, a small object so it can be checkpointed."""

    wait: int = 0
    best: float | None = None
    best_epoch: int = 0
    stopped_epoch: int = 0
    best_weights: Any = None


class EarlyStopping(MonitorCallback):
    """Stops training when `monitor` has stopped improving.

    Same arguments and rules as Keras' `EarlyStopping`. The monitored value is the exact global
    one (every replica and worker), so the decision is the same on every worker; the trainer
    also agrees on it across workers before acting.

    Args:
      monitor: the log entry to watch, e.g. ``"val_loss"``.
      min_delta: smallest change that counts as an improvement.
      patience: epochs without improvement before stopping.
      mode: ``"auto"``, ``"min"`` or ``"max"`` (anything else is a ValueError).
      baseline: training stops unless the value beats this within `patience` epochs.
      restore_best_weights: at the end, restore the weights of the best epoch.
      start_from_epoch: epochs to wait before watching at all.
    """

    stops_in_batches = False

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0, verbose: int = 0,
                 mode: str = "auto", baseline: float | None = None, restore_best_weights: bool = False,
                 start_from_epoch: int = 0):
        super().__init__(monitor, mode, min_delta)
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"`patience` must be a non-negative integer, got patience={patience!r}.")
        self.patience = patience
        self.verbose = verbose
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.state = EarlyStoppingState()

    @property
    def wait(self) -> int:
        return self.state.wait

    @property
    def best(self) -> float | None:
        return self.state.best

    @property
    def stopped_epoch(self) -> int:
        return self.state.stopped_epoch

    @property
    def best_epoch(self) -> int:
        return self.state.best_epoch

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.state = EarlyStoppingState()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        current = self.get_monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        st = self.state
        assert self.trainer is not None
        if self.restore_best_weights and st.best_weights is None:
            st.best_weights = self.trainer.get_weights()
            st.best_epoch = epoch
        st.wait += 1
        if self.is_improvement(current, st.best):
            st.best, st.best_epoch = current, epoch
            if self.restore_best_weights:
                st.best_weights = self.trainer.get_weights()
            if self.baseline is None or self.is_improvement(current, self.baseline):
                st.wait = 0
            return
        if st.wait >= self.patience and epoch > 0:
            st.stopped_epoch = epoch
            self.trainer.stop_training = True

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        st = self.state
        if st.stopped_epoch > 0 and self.verbose:
            print(f"Epoch {st.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and st.best_weights is not None:
            assert self.trainer is not None
            if self.verbose:
                print(f"Restoring model weights from the end of the best epoch: {st.best_epoch + 1}.")
            self.trainer.set_weights(st.best_weights)

    def get_state(self) -> dict[str, Any]:
        out = dataclasses.asdict(self.state)
        if out["best_weights"] is not None:  # a list of arrays, whatever the model's weight structure
            out["best_weights"] = [np.asarray(w) for w in jax.tree.leaves(out["best_weights"])]
        return out

    def set_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if state.get("best_weights") is not None and self.trainer is not None:
            structure = jax.tree.structure(self.trainer.get_weights())
            state["best_weights"] = jax.tree.unflatten(structure, list(state["best_weights"]))
        self.state = EarlyStoppingState(**state)
