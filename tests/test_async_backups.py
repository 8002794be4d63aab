"""Backups written in the background (`BackupAndRestore(async_save=True)`, the default): training
goes on while a backup is written, the backup holds the state of its step (not of a later one), a
write that fails is reported and never leaves a backup that a resume would take, and a resume
from a background backup equals the uninterrupted run."""

import os
import threading
import time

import jax
import numpy as np
import pytest

import lockstep as ls
from lockstep.checkpoint import TrainingCheckpointer

import common


class _SlowWriter:
    """Makes every background write of `TrainingCheckpointer` start `delay` s late and notes when
    each write (by step) ended, and on which thread."""

    def __init__(self, monkeypatch, delay):
        original = TrainingCheckpointer._write
        self.threads, self.ended = set(), {}

        def slow(store, step, *args):
            self.threads.add(threading.current_thread().name)
            time.sleep(delay)
            original(store, step, *args)
            self.ended[step] = time.perf_counter()
        monkeypatch.setattr(TrainingCheckpointer, "_write", slow)


class _StopAt(ls.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.at:
            raise KeyboardInterrupt


def _fit(callbacks, epochs=2):
    x, y = common.data(200)
    t = common.trainer(ls.MirroredStrategy(2))
    hist = t.fit(x, y, batch_size=32, epochs=epochs, seed=3, verbose=0, callbacks=callbacks)
    return t, hist


def test_training_goes_on_while_a_backup_is_written_and_the_backup_holds_its_steps_state(monkeypatch, tmp_path):
    writer = _SlowWriter(monkeypatch, 0.3)
    backup = ls.callbacks.BackupAndRestore(tmp_path, save_freq=3, delete_checkpoint=False)
    returned = {}  # global step -> when the backup's hook returned
    states = {}

    class Keep(ls.callbacks.Callback):  # each step's weights, to compare with the backup of that step
        def on_train_batch_end(self, batch, logs=None):
            states[self.model.global_step] = [np.asarray(w) for w in jax.tree.leaves(self.model.get_weights())]

    class Returned(ls.callbacks.Callback):  # runs after the backup's hooks (which run last), at the next step
        def on_train_batch_begin(self, batch, logs=None):
            returned[self.model.global_step] = time.perf_counter()
    _fit([backup, Keep(), Returned()], epochs=1)  # 7 steps: backups at 3 and 6
    assert writer.threads == {"lockstep-backup_0"}  # written by the writer's thread
    assert returned[3] < writer.ended[3]  # training went on (step 4 began) before the backup of step 3 was written
    assert returned[6] > writer.ended[3]  # the save of step 6 waited for it: one backup in flight at a time
    store = TrainingCheckpointer(tmp_path)
    assert store.all_steps() == [3, 6]
    arrays, _ = store.restore(3)
    store.close()
    saved = [arrays[k] for k in sorted(arrays) if k.startswith("params/")]
    for a, b in zip(saved, states[3]):  # step 3's weights, though training went on while it was written
        np.testing.assert_array_equal(a, b)


def test_a_failed_background_write_is_an_error_and_leaves_no_backup(monkeypatch, tmp_path):
    original = TrainingCheckpointer._write

    def half(store, step, arrays, meta):
        if step == 6:
            raise OSError("disk full (made up)")
        return original(store, step, arrays, meta)
    monkeypatch.setattr(TrainingCheckpointer, "_write", half)
    backup = ls.callbacks.BackupAndRestore(tmp_path, save_freq=3, delete_checkpoint=False)
    with pytest.raises(OSError, match="disk full"):
        _fit([backup], epochs=2)  # reported at the next save (step 9) or the end of fit
    store = TrainingCheckpointer(tmp_path)
    assert 6 not in store.all_steps() and 3 in store.all_steps()
    store.close()


def test_a_background_write_lets_each_device_copy_go_once_it_is_on_the_host(tmp_path):
    """A background write copies each array to the host once (for the checksums and orbax) and
    lets its device copy go then, not when the write ends: while orbax is still writing, no device
    array handed to the save is alive; the backup holds them. (Arrays split over the 8 devices: a
    CPU device's array that lies whole is the host's memory, which NumPy reads in place.)"""
    import gc
    import weakref

    store = TrainingCheckpointer(tmp_path, async_save=True)
    writing, release = threading.Event(), threading.Event()
    save = store._manager.save

    def held_save(*args, **kwargs):
        writing.set()
        release.wait(30)
        return save(*args, **kwargs)
    store._manager.save = held_save
    split = jax.sharding.NamedSharding(jax.make_mesh((8,), ("d",)), jax.sharding.PartitionSpec("d"))
    arrays = {f"a{i}": jax.device_put(np.arange(1000.0) + i, split) for i in range(3)}
    refs = [weakref.ref(a) for a in arrays.values()]
    store.save(1, arrays, {"epoch": 0})
    del arrays
    try:
        assert writing.wait(30)
        gc.collect()
        alive = [r() is not None for r in refs]
    finally:
        release.set()
    store.wait()
    assert alive == [False] * 3
    got, _ = store.restore(1)
    store.close()
    for i in range(3):
        np.testing.assert_array_equal(got[f"a{i}"], np.arange(1000.0) + i)


def test_a_resume_from_a_background_backup_equals_the_uninterrupted_run(tmp_path):
    ref, ref_hist = _fit([], epochs=2)
    with pytest.raises(KeyboardInterrupt):
        _fit([ls.callbacks.BackupAndRestore(tmp_path, save_freq=4), _StopAt(9)], epochs=2)
    backup = ls.callbacks.BackupAndRestore(tmp_path, save_freq=4)
    t, hist = _fit([backup], epochs=2)
    assert backup.restored_from == 8
    for a, b in zip(jax.tree.leaves(t.get_weights()), jax.tree.leaves(ref.get_weights())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hist.history == ref_hist.history


def test_model_checkpoint_writes_in_the_background_each_file_holding_its_epochs_weights(monkeypatch, tmp_path):
    """`ModelCheckpoint(async_save=True)` (the default): the next epoch begins before the file of
    the last one is written, one write in flight, and every file holds the weights of its epoch,
    as a synchronous `ModelCheckpoint` writes them; `fit` returns with every file written."""
    import lockstep.training._weight_files as weight_files
    original, threads, ended = weight_files.save_tree, set(), {}

    def slow(path, tree, **extra):
        threads.add(threading.current_thread().name)
        time.sleep(0.3)
        original(path, tree, **extra)
        ended[path] = time.perf_counter()
    monkeypatch.setattr(weight_files, "save_tree", slow)
    began, weights = {}, {}

    class Keep(ls.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            began[epoch] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            weights[epoch] = [np.asarray(w) for w in jax.tree.leaves(self.model.get_weights())]
    background = ls.callbacks.ModelCheckpoint(str(tmp_path / "bg-{epoch}.npz"), save_weights_only=True)
    _fit([Keep(), background], epochs=3)
    assert threads == {"lockstep-model-checkpoint_0"}
    assert began[1] < ended[str(tmp_path / "bg-1.npz")]  # epoch 2 began before epoch 1's file was written
    assert began[2] > ended[str(tmp_path / "bg-1.npz")]  # epoch 2's save waited for it
    monkeypatch.setattr(weight_files, "save_tree", original)
    now = ls.callbacks.ModelCheckpoint(str(tmp_path / "now-{epoch}.npz"), save_weights_only=True, async_save=False)
    t, _ = _fit([now], epochs=3)
    like = t.get_weights()
    for epoch in range(3):
        got, _ = ls.checkpoint.load_tree(tmp_path / f"bg-{epoch + 1}.npz", like)
        want, _ = ls.checkpoint.load_tree(tmp_path / f"now-{epoch + 1}.npz", like)
        for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), weights[epoch]):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(a, b)


def test_model_checkpoint_in_the_background_reads_the_state_to_the_host_on_its_writer_thread(monkeypatch, tmp_path):
    """A background `ModelCheckpoint` hands its writer copies made on the devices: every read of
    the weights (and optimizer state) to the host is on the writer's thread, and the step's logs
    are not read where the path names none of them, so the training thread waits neither for the
    steps queued nor for the host; the files, saved every 3 steps of 7 (the next step takes the
    saved arrays over), equal those a synchronous `ModelCheckpoint` writes."""
    import lockstep.training._logs as logs
    import lockstep.training._weights as weights
    original, threads, read_logs = weights.host_value, [], []

    def noted(a):
        threads.append(threading.current_thread().name)
        return original(a)
    monkeypatch.setattr(weights, "host_value", noted)
    get = logs.LazyLogs._get
    monkeypatch.setattr(logs.LazyLogs, "_get", lambda self: read_logs.append(1) or get(self))

    def checkpoints(kind, **settings):
        return [ls.callbacks.ModelCheckpoint(str(tmp_path / f"{kind}-w-{{epoch}}.npz"), save_weights_only=True,
                                             save_freq=3, **settings),
                ls.callbacks.ModelCheckpoint(str(tmp_path / f"{kind}-s-{{epoch}}.npz"), save_freq=3, **settings)]
    _fit(checkpoints("bg"), epochs=2)
    monkeypatch.setattr(weights, "host_value", original)
    assert threads and set(threads) == {"lockstep-model-checkpoint_0"}
    assert not read_logs  # (the paths name no log field: a step's logs, read, would wait for it)
    t, _ = _fit(checkpoints("now", async_save=False), epochs=2)
    like = {"weights": t.get_weights(), "opt_state": jax.tree.map(np.asarray, t.current_state().opt_state)}
    for epoch in (1, 2):
        got, _ = ls.checkpoint.load_tree(tmp_path / f"bg-w-{epoch}.npz", like["weights"])
        want, _ = ls.checkpoint.load_tree(tmp_path / f"now-w-{epoch}.npz", like["weights"])
        got_state, extra = ls.checkpoint.load_tree(tmp_path / f"bg-s-{epoch}.npz", like)
        want_state, want_extra = ls.checkpoint.load_tree(tmp_path / f"now-s-{epoch}.npz", like)
        assert extra == want_extra
        for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state))):
            np.testing.assert_array_equal(a, b)
    assert not any(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(t.get_weights())))


def test_a_failed_model_checkpoint_write_is_raised_and_leaves_the_file_before_it(monkeypatch, tmp_path):
    import lockstep.training._weight_files as weight_files
    original = weight_files.save_tree
    path = tmp_path / "w.npz"

    def fails_second(p, tree, **extra):
        if os.path.exists(p):
            raise OSError("disk full")
        original(p, tree, **extra)
    monkeypatch.setattr(weight_files, "save_tree", fails_second)
    with pytest.raises(OSError, match="disk full"):
        _fit([ls.callbacks.ModelCheckpoint(str(path), save_weights_only=True)], epochs=3)
    assert os.path.exists(path) and not [f for f in os.listdir(tmp_path) if f != "w.npz"]  # no stray temporary file
