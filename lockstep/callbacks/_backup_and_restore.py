"""`BackupAndRestore`: resume an interrupted `fit` exactly where it stopped."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..cluster import backups_take_sigterm
from .._exit_codes import PREEMPTED_EXIT_CODE
from ..engine import allgather_sizes, broadcast_from_chief
from ._callback import Callback

if TYPE_CHECKING:
    from ..checkpoint import TrainingCheckpointer


class BackupAndRestore(Callback):
    """Backs up the whole training state so an interrupted `fit` resumes where it stopped.

    A backup holds the weights and optimizer state, the epoch and step, the seed (shuffling is
    derived from the seed and the epoch), the data position, the metric state of the epoch in
    progress, the `History`, and every callback's state (EarlyStopping's wait / best / best
    weights, ModelCheckpoint's best value, ReduceLROnPlateau's counters). On `fit`, an existing
    backup is restored and training continues from that exact step, so the finished run equals
    an uninterrupted one. Writes go through orbax-checkpoint, in the background while training
    goes on (`async_save`: a save hands the step's arrays to a writer and returns; a backup
    still being written is finished before the next, at the end of `fit` and before a
    preempted worker exits), and atomic: a crash, during a write too, leaves the last complete
    backup; a backup damaged on disk afterwards is detected by its checksums, set aside
    with a warning, and the newest intact one is used. A backup is the trainer's `TrainState` (`trainer.train_state`), restored
    with `trainer.restore`. Callback states are matched by class and order among callbacks of
    that class, so a restart may add or drop callbacks; a new one starts fresh. Its hooks run after
    every other callback's (wherever it is listed), so a backup holds their state after the step
    or epoch, and the `History` with that epoch.

    On SIGTERM (preemption) every worker finishes its current step, all agree on one step (JAX's
    preemption sync point across workers), save a backup there, and exit with
    `PREEMPTED_EXIT_CODE` (83). `lockstep launch --max-restarts K` restarts the job.

    Args:
      backup_dir: where backups live (shared by all workers).
      save_freq: ``"epoch"``, or a number of training steps between backups (with
        ``steps_per_execution=k``, at the end of the call in which a multiple of it is reached).
      delete_checkpoint: delete the backups when `fit` finishes.
      async_save: write backups in the background (a writer thread in one process, orbax's
        async checkpointing with several workers); False: each save returns when its backup is
        committed.
    """

    stops_in_batches = False

    #: `fit` calls its hooks after every other callback's (see `CallbackList`)
    runs_last = True

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, async_save: bool = True):
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"`save_freq` must be 'epoch' or a positive integer, got save_freq={save_freq!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.async_save = bool(async_save)
        self._store: TrainingCheckpointer | None = None
        self._preempted = threading.Event()
        self._old_handler: Any = None
        self.restored_from: int | None = None
        self._saved_step: int | None = None
        self._first = 0  # the number of the first step of the call in progress
        self._calls = 0  # calls of the compiled steps so far: the workers' preemption sync counter

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        from ..checkpoint import TrainingCheckpointer

        self._store = TrainingCheckpointer(self.backup_dir, async_save=self.async_save)
        self._saved_step = None
        self._preempted.clear()
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: self._preempted.set())
        backups_take_sigterm(self, jax.process_count() > 1)  # several workers: the runtime's preemption notice
        self._restore_latest()  # the trainer takes it up once every callback has begun

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._store is not None and self.delete_checkpoint:
            try:
                self._store.delete_all()
            except Exception as e:  # noqa: BLE001 - training is done: a leftover backup must not lose it
                warnings.warn(f"BackupAndRestore: training finished, but the backups in {self.backup_dir!r} could not "
                              f"be deleted ({type(e).__name__}: {e}); delete them before the next fit, or it "
                              "resumes from them.", RuntimeWarning, stacklevel=2)

    def on_train_exit(self) -> None:
        """Puts the SIGTERM handler back and closes the store, however `fit` ended."""
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None
        backups_take_sigterm(self, False)  # SIGTERM ends a worker again
        if self._store is not None:
            self._store.close()
            self._store = None

    # --- saving ------------------------------------------------------------------------------
    def _save(self) -> None:
        """Backs up the state at the current step; a step already backed up is not written again
        (a preemption agreed at a periodic backup step: orbax writes each step once)."""
        assert self.trainer is not None and self._store is not None
        if self._saved_step == self.trainer.global_step:
            return
        # every worker's data position: all save at this step (a save written in the background: copies of the
        # arrays the next step takes over)
        state = self.trainer.shared_train_state(copy=self.async_save)
        arrays, meta = state.to_arrays()
        self._store.save(state.global_step, arrays, meta)
        self._saved_step = state.global_step

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._first = batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """After one call of the compiled steps (`steps_per_execution` steps: `batch` is the last's
        number): a backup when a multiple of `save_freq` steps was reached during the call, and the
        workers' check for a preemption (once a call, on every worker alike)."""
        if self.trainer is None:
            return
        step = self.trainer.global_step
        before = step - (batch - self._first + 1)
        if self.save_freq != "epoch" and step // int(self.save_freq) > before // int(self.save_freq):
            self._save()
        self._calls += 1
        if self.preempted(self._calls):
            self.save_and_exit()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            self._save()

    def preempted(self, counter: int) -> bool:
        """Whether every worker has agreed to stop at `counter` (SIGTERM received): JAX's sync point
        needs a counter that every worker advances by one at the same places (here, once a call)."""
        if jax.process_count() == 1:
            return self._preempted.is_set()
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(counter))

    def save_and_exit(self) -> None:
        """Saves a backup at the agreed step and ends the process with `PREEMPTED_EXIT_CODE`."""
        self._save()
        self.wait()  # committed before the process ends
        print(f"lockstep: preempted: backup saved at step {self.trainer.global_step if self.trainer else '?'}; "
              f"exiting with code {PREEMPTED_EXIT_CODE}.", flush=True)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def wait(self) -> None:
        """Returns when every backup saved so far is committed, as every worker then knows (every
        worker calls it together: a barrier)."""
        if self._store is not None:
            self._store.wait(everywhere=True)

    # --- restoring ---------------------------------------------------------------------------
    def _restore_latest(self) -> None:
        """Hands the newest intact backup, if any, to the trainer (`trainer.restore`). A damaged
        one (unreadable, or its checksums differ) is named in a warning and set aside in the
        ``damaged`` folder, and the next older one is tried; every worker takes the same one."""
        from ..checkpoint import DamagedCheckpointError

        assert self.trainer is not None and self._store is not None
        like = self.trainer.current_state()  # (its shardings)
        arrays_like, _ = like.to_arrays()
        # the metric state (one entry per replica) comes back whole, replicated: it may have been
        # taken on another number of replicas, and the trainer reduces it then (`TrainState`)
        shardings = {k: v.sharding for k, v in arrays_like.items()
                     if isinstance(v, jax.Array) and not k.startswith(like.METRIC_STATE_PREFIX)}
        replicated = jax.sharding.NamedSharding(self.trainer.strategy.mesh, jax.sharding.PartitionSpec())
        tried: set[int] = set()
        damaged_any = False
        while True:
            # worker 0's newest untried backup: every worker tries the same one, however its own
            # listing of a shared directory lags
            mine = [s for s in self._store.all_steps() if s not in tried]
            step = int(broadcast_from_chief(np.asarray(mine[-1] if mine else -1, np.int32)))
            if step < 0:
                break
            tried.add(step)
            why = None
            try:
                if step not in mine:
                    raise DamagedCheckpointError(step, "not visible on this worker")
                arrays, meta = self._store.restore(step, shardings, default_sharding=replicated)
            except DamagedCheckpointError as e:
                why = e.why
            damaged = allgather_sizes(int(why is not None))  # all workers agree: intact everywhere, or set aside
            if not damaged.any():
                self.trainer.restore(like.from_arrays(arrays, meta))
                self.restored_from = step
                return
            damaged_any = True
            aside = self._store.set_aside(step)
            where = why or f"as read on worker(s) {[int(w) for w in np.flatnonzero(damaged)]}"
            warnings.warn(f"BackupAndRestore: the backup of step {step} is damaged ({where}); it was moved to "
                          f"{aside!r}, and the next older backup, if any, is tried.", RuntimeWarning, stacklevel=2)
        if damaged_any:
            warnings.warn(f"BackupAndRestore: no intact backup is left in {self.backup_dir!r}: training starts from "
                          "the beginning (the damaged backups are in its 'damaged' folder).", RuntimeWarning,
                          stacklevel=2)
