"""`BackupAndRestore`: resume an interrupted `fit` exactly where it stopped."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ._callback import Callback

if TYPE_CHECKING:
    from ..checkpoint import TrainingCheckpointer

#: Exit code of a worker that was preempted (SIGTERM) after saving a backup at the agreed step.
PREEMPTED_EXIT_CODE = 83


@dataclasses.dataclass
class ResumePoint:
    """Where a restored `fit` continues: `step` batches of `epoch` are already done."""

    epoch: int
    step: int
    global_step: int
    metric_state: Any


def _split_state(state: dict[str, Any], prefix: str, arrays: dict[str, Any]) -> dict[str, Any]:
    """JSON-able entries stay; lists of arrays move to `arrays` and leave a marker."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, list) and v and all(isinstance(a, (np.ndarray, jax.Array)) for a in v):
            for i, a in enumerate(v):
                arrays[f"{prefix}{k}/{i:05d}"] = np.asarray(a)
            out[k] = {"__arrays__": f"{prefix}{k}/", "count": len(v)}
        else:
            out[k] = v
    return out


def _join_state(state: dict[str, Any], arrays: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict) and "__arrays__" in v:
            out[k] = [arrays[f"{v['__arrays__']}{i:05d}"] for i in range(v["count"])]
        else:
            out[k] = v
    return out


class BackupAndRestore(Callback):
    """Backs up the whole training state so an interrupted `fit` resumes where it stopped.

    A backup holds the weights and optimizer state, the epoch and step, the seed (shuffling is
    derived from the seed and the epoch), the data position, the metric state of the epoch in
    progress, the `History`, and every callback's state (EarlyStopping's wait / best / best
    weights, ModelCheckpoint's best value, ReduceLROnPlateau's counters). On `fit`, an existing
    backup is restored and training continues from that exact step, so the finished run equals
    an uninterrupted one. Writes go through orbax-checkpoint (atomic: a crash leaves the last
    complete backup). Callback states are matched by class and order among callbacks of that
    class, so a restart may add or drop callbacks; a new one starts fresh.

    On SIGTERM (preemption) every worker finishes its current step, all agree on one step (JAX's
    preemption sync point across workers), save a backup there, and exit with
    `PREEMPTED_EXIT_CODE` (83). `lockstep launch --max-restarts K` restarts the job.

    Args:
      backup_dir: where backups live (shared by all workers).
      save_freq: ``"epoch"``, or a number of training steps between backups.
      delete_checkpoint: delete the backups when `fit` finishes.
    """

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True):
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"`save_freq` must be 'epoch' or a positive integer, got save_freq={save_freq!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self._store: TrainingCheckpointer | None = None
        self._preempted = threading.Event()
        self._old_handler: Any = None
        self._others: list[Callback] = []
        self.restored_from: int | None = None
        self._saved_step: int | None = None

    # --- wiring ----------------------------------------------------------------------------
    def attach(self, callbacks: list[Callback]) -> None:
        """The callbacks whose state goes into each backup (the trainer calls this)."""
        self._others = [cb for cb in callbacks if cb is not self]

    def _keyed(self) -> dict[str, Callback]:
        """The other callbacks by class name and rank among that class (``"EarlyStopping.0"``), so a
        restart whose callback list differs restores each saved state into the matching callback."""
        seen: dict[str, int] = {}
        out = {}
        for cb in self._others:
            name = type(cb).__name__
            out[f"{name}.{seen.get(name, 0)}"] = cb
            seen[name] = seen.get(name, 0) + 1
        return out

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        from ..checkpoint import TrainingCheckpointer

        self._store = TrainingCheckpointer(self.backup_dir)
        self._saved_step = None
        self._preempted.clear()
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: self._preempted.set())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None
        if self._store is not None:
            if self.delete_checkpoint:
                self._store.delete_all()
            self._store.close()
            self._store = None

    # --- saving ------------------------------------------------------------------------------
    def _save(self) -> None:
        """Backs up the state at the current step; a step already backed up is not written again
        (a preemption agreed at a periodic backup step: orbax writes each step once)."""
        assert self.trainer is not None and self._store is not None
        t = self.trainer
        if self._saved_step == t._global_step:
            return
        epoch, step, metric_state = t._progress
        arrays = t._state_arrays(metric_state)
        callbacks = {key: _split_state(cb.get_state(), f"callbacks/{key}/", arrays) for key, cb in self._keyed().items()}
        meta = {"epoch": epoch, "step": step, "global_step": t._global_step, "seed": t._fit_seed,
                "history": t.history.get_state() if t.history is not None else None, "callbacks": callbacks}
        self._store.save(t._global_step, arrays, meta)
        self._saved_step = t._global_step

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.save_freq != "epoch" and self.trainer is not None and self.trainer._global_step % int(self.save_freq) == 0:
            self._save()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            self._save()

    def preempted(self, global_step: int) -> bool:
        """Whether every worker has agreed to stop after `global_step` (SIGTERM received)."""
        if jax.process_count() == 1:
            return self._preempted.is_set()
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(global_step))

    def save_and_exit(self) -> None:
        """Saves a backup at the agreed step and ends the process with `PREEMPTED_EXIT_CODE`."""
        self._save()
        print(f"lockstep: preempted: backup saved at step {self.trainer._global_step if self.trainer else '?'}; "
              f"exiting with code {PREEMPTED_EXIT_CODE}.", flush=True)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    # --- restoring ---------------------------------------------------------------------------
    def restore(self) -> ResumePoint | None:
        """Loads the newest backup into the trainer and callbacks (the trainer calls this right
        after `on_train_begin`); returns where to continue, or None without a backup."""
        assert self.trainer is not None and self._store is not None
        step = self._store.latest_step()
        if step is None:
            return None
        from ..checkpoint import shardings_of

        t = self.trainer
        shardings = shardings_of(t._state_arrays(t._fresh_state()))
        arrays, meta = self._store.restore(step, shardings, default_sharding=t.strategy._replicated)
        metric_state = t._load_state_arrays(arrays)
        host = {k: np.asarray(v) for k, v in arrays.items() if k.startswith("callbacks/")}
        for key, cb in self._keyed().items():
            if key in meta["callbacks"]:  # a callback new since the backup keeps its fresh state
                cb.set_state(_join_state(meta["callbacks"][key], host))
        if t.history is not None and meta.get("history") is not None:
            t.history.set_state(meta["history"])
        t._global_step = int(meta["global_step"])
        self.restored_from = step
        return ResumePoint(int(meta["epoch"]), int(meta["step"]), int(meta["global_step"]), metric_state)
