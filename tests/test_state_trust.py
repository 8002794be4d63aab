"""State you can trust: whatever ends a `fit`, the Keras model keeps the weights trained so far,
and everything lockstep installed (the SIGTERM handler, open files) is put back."""

import signal

import keras
import numpy as np
import optax
import pytest

import lockstep as ls
from suite import variants

N, B = 96, 16
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)
HOOKS = ["on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end", "on_epoch_end",
         "on_test_begin", "on_test_batch_end", "on_test_end", "on_train_end"]


class Boom(Exception):
    pass


class RaiseAt(ls.callbacks.Callback):
    """Raises `error` in `hook` once the trainer has taken `step` optimizer steps (0: at once)."""

    def __init__(self, hook, error=Boom, step=0):
        super().__init__()
        self.step, self.error = step, error
        setattr(self, hook, self._maybe_raise)

    def _maybe_raise(self, *args, **kwargs):
        if self.model.global_step >= self.step:
            raise self.error("raised by the test")


class StopAfter(ls.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.step:
            self.model.stop_training = True


def keras_trainer(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    return ls.Trainer(model, optimizer=optax.adam(0.05), loss="sparse_categorical_crossentropy_from_logits",
                      metrics=["accuracy"], strategy=strategy)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_interrupted_fit_leaves_the_keras_model_with_the_weights_of_its_last_step(error):
    strategy = ls.MirroredStrategy(4)
    t = keras_trainer(strategy)
    with pytest.raises(error):
        t.fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0, callbacks=[RaiseAt("on_train_batch_end", error, 8)])
    assert t.global_step == 8
    got = [np.asarray(v) for v in t.model.get_weights()]  # the Keras model itself
    ref = keras_trainer(strategy)  # the same 8 steps, ended normally (6 steps an epoch)
    ref.fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0, callbacks=[StopAfter(8)])
    want = [np.asarray(v) for v in ref.model.get_weights()]
    untrained = [np.asarray(v) for v in keras_trainer(strategy).model.get_weights()]
    assert any(not np.array_equal(a, b) for a, b in zip(got, untrained))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hook", HOOKS)
def test_an_exception_in_any_hook_restores_the_sigterm_handler(hook, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    t = keras_trainer(ls.MirroredStrategy(2))
    callbacks = [ls.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=2),
                 ls.callbacks.CSVLogger(str(tmp_path / "log.csv")), RaiseAt(hook)]
    with pytest.raises(Boom):
        t.fit(X, Y, batch_size=B, epochs=1, verbose=0, validation_data=(X[:20], Y[:20]), callbacks=callbacks)
    assert signal.getsignal(signal.SIGTERM) is before
    assert callbacks[1]._file is None  # the CSV file is closed


def test_a_backup_directory_made_read_only_at_the_end_warns_and_fit_returns_its_history(tmp_path, monkeypatch):
    """Deleting the backups is the last thing `fit` does: if it fails, training is not lost."""
    from lockstep.checkpoint import TrainingCheckpointer

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(TrainingCheckpointer, "delete_all", refuse)
    t = keras_trainer(ls.MirroredStrategy(2))
    with pytest.warns(RuntimeWarning, match="could not be deleted"):
        hist = t.fit(X, Y, batch_size=B, epochs=2, verbose=0,
                     callbacks=[ls.callbacks.BackupAndRestore(tmp_path, save_freq=3)])
    assert len(hist.history["loss"]) == 2


# --- a backup restored into a changed trainer: matched by name, checked by shape ----------------

def functional(classes=3, width=8):
    import jax
    import jax.numpy as jnp

    def init(key, x):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (x.shape[-1], width)) * 0.4, "b1": jnp.zeros(width),
                "w2": jax.random.normal(k2, (width, classes)) * 0.4, "b2": jnp.zeros(classes)}
    return ls.FunctionalModel(init, lambda p, x, training=False: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])


def resumable(metrics=("accuracy",), optimizer=None, replicas=2, **model):
    return ls.Trainer(functional(**model), optimizer=optimizer or optax.adam(0.05),
                      loss="sparse_categorical_crossentropy_from_logits", metrics=list(metrics),
                      strategy=ls.MirroredStrategy(replicas))


def interrupted(tmp_path, **kwargs):
    with pytest.raises(Boom):
        resumable(**kwargs).fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0,
                                callbacks=[ls.callbacks.BackupAndRestore(tmp_path, save_freq=3),
                                           RaiseAt("on_train_batch_end", step=10)])  # after the backup of step 9


def resume(tmp_path, **kwargs):
    t = resumable(**kwargs)
    return t, t.fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0,
                    callbacks=[ls.callbacks.BackupAndRestore(tmp_path, save_freq=3)]).history


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.full_suite), 4])
@pytest.mark.parametrize("hook", variants(["on_epoch_begin", "on_train_batch_begin"], {"on_train_batch_begin"}))
def test_a_fit_interrupted_after_an_epoch_end_backup_resumes_with_the_whole_history(hook, replicas, tmp_path):
    """Before: the resume stopped with "`x` yielded no batch in epoch 3" (the pass of the backed-up
    epoch was taken up again at its end), and the backup's History lacked the epoch it was taken at
    (listed after BackupAndRestore, it had not recorded it yet)."""
    n = 90  # 6 batches of 16, the last of 10: 3, 3, 2, 2 rows on 4 replicas
    kw = dict(batch_size=B, epochs=4, seed=1, verbose=0, validation_data=(X[:20], Y[:20]))
    want = resumable(replicas=1).fit(X[:n], Y[:n], **kw).history
    stop = ls.callbacks.EarlyStopping(monitor="val_loss", patience=10)  # its state rides along
    with pytest.raises(Boom):
        resumable(replicas=replicas).fit(X[:n], Y[:n], **kw, callbacks=[
            ls.callbacks.BackupAndRestore(tmp_path), stop, RaiseAt(hook, step=12)])  # in epoch 3, before its 1st step
    t = resumable(replicas=replicas)
    got = t.fit(X[:n], Y[:n], **kw, callbacks=[ls.callbacks.BackupAndRestore(tmp_path), ls.callbacks.EarlyStopping(
        monitor="val_loss", patience=10)]).history
    assert sorted(got) == sorted(want) and len(got["loss"]) == 4
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def want(tmp_path_factory):
    """The uninterrupted run's history on one device (the reference every resume is held to)."""
    return resumable(replicas=1).fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0).history


@pytest.mark.parametrize("change, match", [
    ({"classes": 5}, r"`\['trainable'\]\['b2'\]` of the model's weights \(params/00001\) is "
                     r"float32\[3\] in the backup and float32\[5\] here"),
    ({"width": 16}, r"`\['trainable'\]\['b1'\]` of the model's weights \(params/00000\) is float32\[8\] "
                    r"in the backup and float32\[16\]"),
    ({"optimizer": optax.sgd(0.1)}, r"taken with the optimizer `ScaleByAdamState, EmptyState`, and this trainer's is "
                                    r"`EmptyState, EmptyState`"),
    ({"optimizer": optax.rmsprop(0.05)}, r"`ScaleByAdamState, EmptyState`, and this trainer's is `ScaleByRmsState, "),
    # the same arrays in number and shape: told apart by the optimizer's own structure
    ({"optimizer": optax.adamw(0.05)}, r"`ScaleByAdamState, EmptyState`, and this trainer's is "
                                       r"`ScaleByAdamState, .*EmptyState`"),
])
def test_a_backup_of_another_model_or_optimizer_is_refused_naming_the_first_difference(change, match, tmp_path):
    interrupted(tmp_path)
    with pytest.raises(ValueError, match=match):
        resume(tmp_path, **change)


def test_a_backup_without_names_still_restores_by_position(tmp_path, monkeypatch, want):
    """Backups written before names were recorded restore as they did, checked by position."""
    plain = ls.TrainState.to_arrays
    monkeypatch.setattr(ls.TrainState, "to_arrays", lambda state: plain(state.replace(names=None)))
    interrupted(tmp_path / "a")
    _, got = resume(tmp_path / "a")
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    interrupted(tmp_path / "b")
    with pytest.raises(ValueError, match=r"array 1 of the model's weights \(params/00001, params\['trainable'\]"):
        resume(tmp_path / "b", classes=5)


def keras_resumable(optimizer="adam", classes=2, extra_layer=False):
    keras.utils.set_random_seed(3)
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu")]
    layers += [keras.layers.Dense(8, activation="relu")] if extra_layer else []
    model = keras.Sequential(layers + [keras.layers.BatchNormalization(), keras.layers.Dense(classes)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return ls.Trainer(model, strategy=ls.MirroredStrategy(2))


def keras_fit(trainer, backup, **kwargs):
    return trainer.fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0,
                       callbacks=[ls.callbacks.BackupAndRestore(backup, save_freq=3)], **kwargs).history


def keras_interrupted(backup):
    with pytest.raises(Boom):
        keras_resumable().fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0,
                              callbacks=[ls.callbacks.BackupAndRestore(backup, save_freq=3),
                                         RaiseAt("on_train_batch_end", step=10)])  # after the backup of step 9


def test_a_keras_backup_is_matched_by_layer_position_not_by_auto_generated_names(tmp_path):
    want = keras_fit(keras_resumable(), tmp_path / "plain")
    keras_interrupted(tmp_path / "a")
    keras_resumable()  # more models in this process: Keras numbers the next one's layers on (dense_7, ...)
    got = keras_fit(keras_resumable(), tmp_path / "a")
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


@pytest.mark.parametrize("change, match", [
    ({"classes": 3}, r"`dense_1/kernel` of the model's weights \(params/\d+\) is float32\[8, 2\] in the backup "
                     r"and float32\[8, 3\] here"),
    ({"extra_layer": True}, r"\['dense_2/kernel', 'dense_2/bias'\] here are not in the backup"),
    ({"optimizer": "adamw"}, r"taken with the optimizer `keras Adam`, and this trainer's is `keras AdamW`"),
])
def test_a_keras_backup_of_another_model_or_optimizer_is_refused_by_name(change, match, tmp_path):
    keras_interrupted(tmp_path)
    with pytest.raises(ValueError, match=match):
        keras_fit(keras_resumable(**change), tmp_path)


# --- a damaged newest backup: detected, named, set aside; the newest intact one is used -----------

def _truncate(step_dir):
    for f in step_dir.glob("arrays/**/d/*"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_a_bit(step_dir, where="arrays/**/d/*"):
    """One bit in the middle of each of the arrays' files (small arrays sit in the b-tree nodes,
    which tensorstore checks itself; large ones in data files, which only lockstep's checksums check)."""
    for f in step_dir.glob(where):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))


def _garble_json(step_dir):
    (step_dir / "meta" / "metadata").write_text('{"epoch": 1, "st')


def _change_json(step_dir):
    """Valid JSON, one value changed: only the checksum of the meta tells."""
    f = step_dir / "meta" / "metadata"
    f.write_text(f.read_text().replace('"epoch": 1', '"epoch": 0'))


def _zero(step_dir):
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(bytes(f.stat().st_size))


# tensorstore reads still in flight when a damaged file fails the restore end later on orbax's
# closed event loop ("Exception ignored ... Event loop is closed" on stderr): noise, nothing lost
QUIET_STRAY_READS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
DAMAGE = {"truncated": _truncate, "bit_flipped": _flip_a_bit, "json_garbled": _garble_json,
          "json_value_changed": _change_json, "zeroed": _zero}


@QUIET_STRAY_READS
@pytest.mark.parametrize("kind", variants(sorted(DAMAGE), {"truncated", "bit_flipped", "json_value_changed"}))
def test_a_damaged_newest_backup_is_set_aside_and_the_older_one_resumes_exactly(kind, tmp_path, want):
    interrupted(tmp_path / "a")  # backups at steps 6 and 9 (6 steps an epoch)
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if p.name.isdigit()) == ["6", "9"]
    DAMAGE[kind](tmp_path / "a" / "9")
    t = resumable()
    backup = ls.callbacks.BackupAndRestore(tmp_path / "a", save_freq=3)
    with pytest.warns(RuntimeWarning, match=r"the backup of step 9 is damaged \(.+\); it was moved to .*damaged/9'"
                                            r", and the next older backup, if any, is tried"):
        got = t.fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0, callbacks=[backup]).history
    assert backup.restored_from == 6
    assert (tmp_path / "a" / "damaged" / "9").is_dir()
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)


@QUIET_STRAY_READS
def test_a_bit_flipped_in_a_large_array_is_caught_by_the_checksum(tmp_path):
    """Tensorstore keeps large arrays in data files without a checksum of their own: a flipped bit
    reads back as another value. The checksum written with the backup tells."""
    from lockstep.checkpoint import DamagedCheckpointError, TrainingCheckpointer

    store = TrainingCheckpointer(tmp_path)
    w = np.random.default_rng(0).normal(size=(400, 80)).astype(np.float32)
    store.save(9, {"params/00000": w, "params/00001": np.ones(3, np.float32)}, {"epoch": 1})
    _flip_a_bit(tmp_path / "9", where="arrays/ocdbt.process_*/d/*")  # the data files only
    with pytest.raises(DamagedCheckpointError, match=r"checkpoint 9 is damaged: the checksum of 'params/00000' "
                                                     r"differs from the one written"):
        store.restore(9)
    store.set_aside(9)
    assert store.all_steps() == [] and (tmp_path / "damaged" / "9").is_dir()


def test_a_stray_step_folder_is_set_aside(tmp_path, want):
    interrupted(tmp_path / "a")
    (tmp_path / "a" / "999").mkdir()
    (tmp_path / "a" / "999" / "notes.txt").write_text("not a backup")
    backup = ls.callbacks.BackupAndRestore(tmp_path / "a", save_freq=3)
    with pytest.warns(RuntimeWarning, match=r"the backup of step 999 is damaged .*the next older backup"):
        got = resumable().fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0, callbacks=[backup]).history
    assert backup.restored_from == 9
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


@QUIET_STRAY_READS
def test_when_every_backup_is_damaged_training_starts_over_with_a_warning(tmp_path, want):
    interrupted(tmp_path / "a")
    _flip_a_bit(tmp_path / "a" / "9")
    _garble_json(tmp_path / "a" / "6")
    backup = ls.callbacks.BackupAndRestore(tmp_path / "a", save_freq=3)
    with pytest.warns(RuntimeWarning) as warned:
        got = resumable().fit(X, Y, batch_size=B, epochs=2, seed=1, verbose=0, callbacks=[backup]).history
    messages = [str(w.message) for w in warned if "BackupAndRestore" in str(w.message)]
    assert len(messages) == 3 and "step 9 is damaged" in messages[0] and "step 6 is damaged" in messages[1]
    assert "no intact backup is left" in messages[2] and "training starts from the beginning" in messages[2]
    assert backup.restored_from is None
    assert sorted(p.name for p in (tmp_path / "a" / "damaged").iterdir()) == ["6", "9"]
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
