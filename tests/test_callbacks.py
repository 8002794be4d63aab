"""Callbacks: decisions checked against NumPy on scripted curves; files checked on disk."""

import csv
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lockstep as ls


def data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def model():
    return ls.FunctionalModel(lambda rng, x: {"w": jax.random.normal(rng, (4, 2)) * 0.1, "b": jnp.zeros(2)},
                              lambda p, x, training=False: x @ p["w"] + p["b"])


def trainer(r=2, optimizer="sgd"):
    return ls.Trainer(model(), optimizer=optimizer, loss="sparse_categorical_crossentropy_from_logits",
                      metrics=["accuracy"], strategy=ls.MirroredStrategy(r))


class Script(ls.callbacks.Callback):
    """Puts a scripted value into the epoch logs and records the weights of each epoch."""

    def __init__(self, curve, key="val_score"):
        super().__init__()
        self.curve, self.key, self.weights = curve, key, []

    def on_epoch_end(self, epoch, logs=None):
        logs[self.key] = float(self.curve[epoch])
        self.weights.append(self.trainer.get_weights())


def numpy_stop_epoch(curve, patience):
    """Where Keras' rule stops on `curve` (mode min), computed with array operations."""
    curve = np.asarray(curve, float)
    prior_best = np.r_[np.inf, np.minimum.accumulate(curve)[:-1]]
    improved = curve < prior_best
    last = np.maximum.accumulate(np.where(improved, np.arange(len(curve)), 0))
    since = np.arange(len(curve)) - last
    stops = np.flatnonzero((since >= patience) & (np.arange(len(curve)) > 0))
    best_epoch = int(np.argmin(curve[: stops[0] + 1])) if len(stops) else int(np.argmin(curve))
    return (int(stops[0]) if len(stops) else None), best_epoch


@pytest.mark.parametrize("curve,patience", [
    ([1.0, 0.8, 0.85, 0.7, 0.75, 0.72, 0.9, 0.6], 2),
    ([1.0, 1.1, 1.2, 0.5, 0.6, 0.7, 0.8, 0.9], 3),
    ([3.0, 2.0, 1.0, 0.5, 0.4, 0.3, 0.2, 0.1], 1),
])
def test_early_stopping_stops_where_numpy_says_and_restores_the_best_weights(curve, patience):
    x, y = data()
    t = trainer()
    script = Script(curve)
    es = ls.callbacks.EarlyStopping(monitor="val_score", mode="min", patience=patience, restore_best_weights=True)
    hist = t.fit(x, y, batch_size=16, epochs=len(curve), verbose=0, callbacks=[script, es])
    stop, best = numpy_stop_epoch(curve, patience)
    assert hist.epoch[-1] == (stop if stop is not None else len(curve) - 1)
    assert es.stopped_epoch == (stop or 0)
    assert es.best_epoch == best
    jax.tree.map(np.testing.assert_array_equal, t.get_weights(), script.weights[best])


def test_early_stopping_state_is_a_small_checkpointable_object_reset_on_train_begin():
    x, y = data()
    t = trainer()
    es = ls.callbacks.EarlyStopping(monitor="val_score", mode="min", patience=1)
    t.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[Script([1, 2, 3]), es])
    state = es.get_state()
    assert state["wait"] == 1 and state["best"] == 1.0 and state["stopped_epoch"] == 1
    es2 = ls.callbacks.EarlyStopping(monitor="val_score", mode="min", patience=1)
    es2.set_state(state)
    assert es2.get_state() == state
    t.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[Script([5, 4, 3]), es])  # reused: reset
    assert es.stopped_epoch == 0 and es.best == 3.0


def test_monitor_naming_a_missing_metric_warns_once_with_the_names_that_exist():
    x, y = data()
    t = trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(x, y, batch_size=32, epochs=3, verbose=0, validation_split=0.25,
              callbacks=[ls.callbacks.EarlyStopping(monitor="val_f1")])
    msgs = [str(w.message) for w in caught if "val_f1" in str(w.message)]
    assert len(msgs) == 1
    assert "accuracy, loss, val_accuracy, val_loss" in msgs[0]


def test_bad_mode_and_undirected_monitor():
    with pytest.raises(ValueError, match="mode='biggest'"):
        ls.callbacks.EarlyStopping(mode="biggest")
    x, y = data()
    with pytest.raises(TypeError, match="takes `values`"):
        ls.Trainer(model(), loss="sparse_categorical_crossentropy_from_logits", metrics=[ls.metrics.Mean()])
    gap = ls.metrics.MeanMetricWrapper(lambda t, p: jnp.abs(p[:, 1] - p[:, 0]), name="gap")  # no direction
    t = ls.Trainer(model(), loss="sparse_categorical_crossentropy_from_logits", metrics=[gap])
    with pytest.raises(ValueError, match="mode='max' or mode='min'"):
        t.fit(x, y, epochs=1, verbose=0, validation_split=0.25, callbacks=[ls.callbacks.EarlyStopping("val_gap")])


def test_an_object_that_is_not_a_callback_is_named():
    x, y = data()
    with pytest.raises(TypeError, match="must hold lockstep callback objects .*, got str"):
        trainer().fit(x, y, epochs=1, verbose=0, callbacks=["early_stopping"])


def test_auto_mode_reads_the_metric_direction():
    x, y = data()
    t = trainer()
    es = ls.callbacks.EarlyStopping(monitor="val_accuracy", patience=0)
    es.set_trainer(t)
    assert es.is_improvement(0.9, 0.8) and not es.is_improvement(0.7, 0.8)


def test_model_checkpoint_best_only_keeps_the_best_epochs_weights(tmp_path):
    x, y = data()
    t = trainer()
    script = Script([0.5, 0.3, 0.4, 0.2, 0.6])
    path = str(tmp_path / "best.npz")
    ck = ls.callbacks.ModelCheckpoint(path, monitor="val_score", mode="min", save_best_only=True,
                                      save_weights_only=True)
    t.fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[script, ck])
    fresh = trainer()
    fresh.evaluate(x, y)  # builds
    fresh.load_weights(path)
    jax.tree.map(np.testing.assert_array_equal, fresh.get_weights(), script.weights[3])
    assert ck.best == 0.2
    assert [p.name for p in tmp_path.iterdir()] == ["best.npz"]  # no temporary file left behind


def test_load_weights_reads_a_full_save_too(tmp_path):
    x, y = data()
    t = trainer()
    t.fit(x, y, batch_size=16, epochs=2, verbose=0)
    path = str(tmp_path / "full.npz")
    t.save(path, epoch=2)  # weights beside optimizer state
    fresh = trainer()
    fresh.evaluate(x, y)
    fresh.load_weights(path)
    jax.tree.map(np.testing.assert_array_equal, fresh.get_weights(), t.get_weights())


def test_model_checkpoint_formats_epoch_and_log_fields(tmp_path):
    x, y = data()
    t = trainer()
    pattern = str(tmp_path / "w-{epoch:02d}-{val_loss:.4f}.npz")
    hist = t.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_split=0.25,
                 callbacks=[ls.callbacks.ModelCheckpoint(pattern, save_weights_only=True)])
    want = sorted(f"w-{e + 1:02d}-{v:.4f}.npz" for e, v in enumerate(hist.history["val_loss"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == want


def test_full_save_of_a_keras_model_and_of_training_state(tmp_path):
    import keras

    x, y = data()
    km = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    t = ls.Trainer(km, strategy=ls.MirroredStrategy(2))
    t.fit(x, y, batch_size=32, epochs=1, verbose=0,
          callbacks=[ls.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), monitor="loss")])
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for a, b in zip(loaded.get_weights(), t.get_weights()):
        np.testing.assert_array_equal(a, b)
    t2 = trainer()
    t2.fit(x, y, batch_size=32, epochs=1, verbose=0,
           callbacks=[ls.callbacks.ModelCheckpoint(str(tmp_path / "state.npz"), monitor="loss")])
    _, extra = ls.checkpoint.load_tree(tmp_path / "state.npz",
                                       {"weights": t2.get_weights(),
                                        "opt_state": jax.tree.map(np.asarray, t2.train_state.opt_state)})
    assert int(extra["epoch"]) == 1


WRITER = textwrap.dedent("""
    import sys, numpy as np, lockstep.checkpoint as ck
    path = sys.argv[1]
    big = np.zeros((2048, 2048), np.float32)
    i = 0
    while True:
        i += 1
        big[:] = i
        ck.save_tree(path, {"a": big, "b": np.full(7, i)}, step=i)
        print(i, flush=True)
""")


def test_a_kill_during_writing_leaves_the_previous_file_intact(tmp_path):
    path = tmp_path / "w.npz"
    rng = np.random.default_rng(0)
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()  # one complete save exists
            assert first.strip()
            time.sleep(rng.uniform(0.0, 0.3))
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
        tree, extra = ls.checkpoint.load_tree(path, {"a": 0, "b": 0})
        step = int(extra["step"])
        assert step >= 1
        assert np.all(tree["a"] == step) and np.all(tree["b"] == step)  # one whole checkpoint, not a mix


def test_csv_logger_history_plot_and_tensorboard(tmp_path):
    x, y = data()
    t = trainer()
    cbs = [ls.callbacks.CSVLogger(tmp_path / "log.csv"), ls.callbacks.TensorBoard(tmp_path / "tb")]
    hist = t.fit(x, y, batch_size=16, epochs=3, verbose=0, validation_split=0.25, callbacks=cbs)
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    for k in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose([float(r[k]) for r in rows], hist.history[k], rtol=1e-6)
    png = hist.plot(tmp_path / "curves.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # TensorBoard event files: TFRecord frames of Event protos, read without TensorFlow
    from tensorboardX.proto import event_pb2

    def scalars(kind):
        out = {}
        for name in os.listdir(tmp_path / "tb" / kind):
            with open(tmp_path / "tb" / kind / name, "rb") as f:
                buf = f.read()
            pos = 0
            while pos < len(buf):
                (length,) = struct.unpack("<Q", buf[pos:pos + 8])
                event = event_pb2.Event.FromString(buf[pos + 12:pos + 12 + length])
                pos += 12 + length + 4
                for v in event.summary.value:
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
        return out
    train, val = scalars("train"), scalars("validation")
    np.testing.assert_allclose([train["epoch_loss"][e] for e in range(3)], hist.history["loss"], rtol=1e-6)
    np.testing.assert_allclose([val["epoch_accuracy"][e] for e in range(3)], hist.history["val_accuracy"], rtol=1e-6)


def test_terminate_on_nan_stops_at_the_first_bad_batch():
    x, y = data(96)
    x[50] = np.nan  # batch 3 of 16-sample batches holds row 50
    t = trainer()
    ton = ls.callbacks.TerminateOnNaN()
    hist = t.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[ton])
    assert ton.terminated_at == (0, 3)
    assert hist.epoch == [0]


def test_learning_rate_scheduler_and_reduce_lr_on_plateau():
    x, y = data()
    t = trainer(optimizer="adam")
    hist = t.fit(x, y, batch_size=32, epochs=3, verbose=0,
                 callbacks=[ls.callbacks.LearningRateScheduler(lambda e, lr: 0.1 / (e + 1))])
    np.testing.assert_allclose(hist.history["learning_rate"], [0.1, 0.05, 0.1 / 3], rtol=1e-6)
    t = trainer(optimizer="sgd")
    curve = [1.0, 0.9, 0.95, 0.97, 0.99, 0.5, 0.6, 0.7]
    rop = ls.callbacks.ReduceLROnPlateau(monitor="val_score", mode="min", factor=0.5, patience=2, min_delta=0.0, min_lr=0.001)
    lrs = []

    class Lr(ls.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            lrs.append(self.trainer.learning_rate)
    t.fit(x, y, batch_size=32, epochs=len(curve), verbose=0, callbacks=[Script(curve), rop, Lr()])
    # plateau after epoch 1: epochs 2, 3 do not improve -> halve at epoch 3; 4 and 5: 5 improves
    np.testing.assert_allclose(lrs, [0.01, 0.01, 0.01, 0.005, 0.005, 0.005, 0.005, 0.0025], rtol=1e-6)


def test_progress_bar_shows_running_global_values(capsys):
    x, y = data()
    t = trainer()
    t.fit(x, y, batch_size=16, epochs=1, verbose=1)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Epoch 1/1" in text and "loss:" in text and "accuracy:" in text


def test_workers_agree_on_stops_after_each_call_only_where_a_callback_may_stop_mid_epoch(monkeypatch):
    """The agreement on `stop_training` (a collective with several workers) runs at each epoch's end,
    and after every call of steps only where some callback may stop before it: a user's callback
    with batch hooks (or a subclass of one of lockstep's), not Keras' EarlyStopping nor the History
    that Keras' `fit` adds (with it, every multi-worker Keras fit agreed after every call)."""
    import keras

    import lockstep.training._evaluation as evaluation
    import lockstep.training._running_metrics as running_metrics

    calls = []
    real = evaluation.allgather_ints
    for module in (evaluation, running_metrics):  # the epoch's agreement, and the one after a call of steps
        monkeypatch.setattr(module, "allgather_ints", lambda values: calls.append(values) or real(values))
    x, y = data()

    class EveryBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    class MyHistory(ls.callbacks.History):
        def on_train_batch_end(self, batch, logs=None):
            pass
    with ls.MirroredStrategy(2).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for callbacks, per_epoch in (([keras.callbacks.EarlyStopping(monitor="loss", patience=5)], 1),
                                 ([EveryBatch()], 1 + 4), ([MyHistory()], 1 + 4)):
        calls.clear()
        model.fit(x, y, batch_size=len(x) // 4, epochs=2, verbose=0, callbacks=callbacks)
        assert len(calls) == 2 * per_epoch, (callbacks, len(calls))
