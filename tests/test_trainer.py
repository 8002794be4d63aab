"""Trainer: evaluate / predict / fit under 1..8 replicas against NumPy, scikit-learn and one device."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from sklearn.metrics import accuracy_score, f1_score

import lockstep as ls

from common import N, data, keras_mlp  # noqa: E402  (the data and models the multi-worker tests use too)
from common import model as functional_mlp  # noqa: E402


def numpy_keras_forward(weights, x):
    w1, b1, w2, b2 = (np.asarray(w, np.float64) for w in weights)
    logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def numpy_functional_forward(p, x):
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    return np.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


@pytest.mark.parametrize("r", [1, 3, 8])
def test_evaluate_and_predict_keras_model_match_numpy(r):
    x, y = data()
    model = keras_mlp()
    trainer = ls.Trainer(model, loss="sparse_categorical_crossentropy",
                         metrics=["accuracy", ls.metrics.F1Score(average="macro")], strategy=ls.MirroredStrategy(r))
    out = trainer.evaluate(x, y, batch_size=64)
    probs = numpy_keras_forward(trainer.get_weights(), x)
    want_loss = np.mean(-np.log(np.clip(probs[np.arange(N), y], 1e-7, 1 - 1e-7)))
    np.testing.assert_allclose(out["loss"], want_loss, rtol=2e-6)
    assert out["accuracy"] == np.float32(accuracy_score(y, probs.argmax(1)))
    np.testing.assert_allclose(out["f1_score"], f1_score(y, probs.argmax(1), average="macro"), rtol=1e-6)
    pred = trainer.predict(x, batch_size=64)
    assert pred.shape == (N, 3)
    np.testing.assert_allclose(pred, model.predict(x, batch_size=N, verbose=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pred, probs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("r", [1, 3, 8])
def test_evaluate_and_predict_functional_model_match_numpy(r):
    x, y = data()
    trainer = ls.Trainer(functional_mlp(), loss="sparse_categorical_crossentropy_from_logits",
                         metrics=["accuracy"], strategy=ls.MirroredStrategy(r))
    out = trainer.evaluate(x, y, batch_size=64)
    logits = numpy_functional_forward(trainer.get_weights(), x)
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    np.testing.assert_allclose(out["loss"], -np.mean(logp[np.arange(N), y]), rtol=2e-6)
    assert out["accuracy"] == np.float32(accuracy_score(y, logits.argmax(1)))
    single = ls.Trainer(functional_mlp(), loss="sparse_categorical_crossentropy_from_logits",
                        strategy=ls.OneDeviceStrategy()).predict(x, batch_size=N)
    pred = trainer.predict(x, batch_size=64)
    assert pred.shape == (N, 3)
    np.testing.assert_allclose(pred, single, rtol=1e-5, atol=1e-6)


class BatchLogRecorder(ls.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.seen = getattr(self, "seen", [])
        self.seen.append(dict(logs))


@pytest.mark.parametrize("model_kind", ["keras", "functional"])
def test_fit_on_8_replicas_equals_fit_on_one(model_kind):
    x, y = data()
    results = {}
    for r in (1, 8):
        model = keras_mlp() if model_kind == "keras" else functional_mlp()
        loss = "sparse_categorical_crossentropy" if model_kind == "keras" else "sparse_categorical_crossentropy_from_logits"
        trainer = ls.Trainer(model, optimizer="adam", loss=loss, metrics=["accuracy"], strategy=ls.MirroredStrategy(r))
        rec = BatchLogRecorder()
        hist = trainer.fit(x, y, batch_size=64, epochs=3, validation_split=0.2, shuffle=True, seed=1, verbose=0,
                           callbacks=[rec])
        results[r] = (trainer.get_weights(), hist.history, rec.seen)
    (w1, h1, b1), (w8, h8, b8) = results[1], results[8]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), w1, w8)
    assert h1.keys() == h8.keys() == {"loss", "accuracy", "val_loss", "val_accuracy"}
    for k in h1:
        np.testing.assert_allclose(h1[k], h8[k], rtol=1e-4, atol=1e-6)
    # per-step logs: running global values over the samples seen so far, identical for R=1 and R=8
    assert len(b1) == len(b8) == 3 * 13
    for a, b in zip(b1, b8):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)
        np.testing.assert_allclose(a["accuracy"], b["accuracy"], rtol=1e-5)


def test_running_batch_logs_are_global_not_per_replica_averages():
    # a constant model: the running loss after each step must be the mean over all samples seen
    x, y = data(200)
    model = ls.FunctionalModel(lambda rng, x: {"b": jnp.zeros(3)}, lambda p, x, training=False: x[:, :3] * 0 + p["b"])
    trainer = ls.Trainer(model, optimizer=optax.sgd(0.0),
                         loss=lambda t, p: ls.losses.mean_squared_error(jax.nn.one_hot(t, 3), p),
                         strategy=ls.MirroredStrategy(8))
    rec = BatchLogRecorder()
    trainer.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    per_sample = np.mean((np.eye(3)[y] - 0) ** 2, axis=1)
    for step, logs in enumerate(rec.seen):
        seen = min((step + 1) * 64, 200)
        np.testing.assert_allclose(logs["loss"], per_sample[:seen].mean(), rtol=1e-6)


def test_sample_weights_and_iterables_of_batches():
    x, y = data(301)
    w = np.random.default_rng(1).integers(0, 3, size=301).astype(np.float32)
    trainer = ls.Trainer(functional_mlp(), loss="sparse_categorical_crossentropy_from_logits", metrics=["accuracy"],
                         strategy=ls.MirroredStrategy(3))
    with pytest.warns(UserWarning, match="Keras 3 weighs only `weighted_metrics`"):
        out = trainer.evaluate(x, y, sample_weight=w, batch_size=50)
    logits = numpy_functional_forward(trainer.get_weights(), x)
    assert out["accuracy"] == np.float32(accuracy_score(y, logits.argmax(1), sample_weight=w))
    gen_out = trainer.evaluate(((x[i:i + 50], y[i:i + 50], w[i:i + 50]) for i in range(0, 301, 50)))
    np.testing.assert_allclose(gen_out["loss"], out["loss"], rtol=1e-6)
    assert gen_out["accuracy"] == out["accuracy"]
    pred = trainer.predict((x[i:i + 77],) for i in range(0, 301, 77))
    assert pred.shape == (301, 3)


def test_keras_model_holds_trained_weights_and_set_weights_syncs():
    x, y = data(256)
    model = keras_mlp()
    trainer = ls.Trainer(model, strategy=ls.MirroredStrategy(4))
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), trainer.get_weights()):
        np.testing.assert_array_equal(a, b)
    zeros = [np.zeros_like(w) for w in trainer.get_weights()]
    trainer.set_weights(zeros)
    assert all(not np.any(w) for w in model.get_weights())


def test_steps_per_epoch_and_initial_epoch():
    x, y = data(200)
    trainer = ls.Trainer(functional_mlp(), loss="sparse_categorical_crossentropy_from_logits",
                         strategy=ls.MirroredStrategy(2))
    rec = BatchLogRecorder()
    hist = trainer.fit(x, y, batch_size=20, epochs=4, initial_epoch=2, steps_per_epoch=3, verbose=0, callbacks=[rec])
    assert hist.epoch == [2, 3]
    assert len(rec.seen) == 6


def test_learning_rate_is_readable_and_settable_without_recompiling():
    x, y = data(64)
    trainer = ls.Trainer(functional_mlp(), optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                         strategy=ls.MirroredStrategy(2))
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert trainer.learning_rate == pytest.approx(0.01)
    compiled = trainer.strategy.extended.compile_counts()
    trainer.learning_rate = 0.0
    before = trainer.get_weights()
    trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
    jax.tree.map(np.testing.assert_array_equal, before, trainer.get_weights())
    assert trainer.strategy.extended.compile_counts() == compiled  # a new learning rate compiles nothing
    with pytest.raises(ValueError, match="inject_hyperparams"):
        t2 = ls.Trainer(functional_mlp(), optimizer=optax.sgd(0.1),
                        loss="sparse_categorical_crossentropy_from_logits")
        t2.fit(x, y, batch_size=32, epochs=1, verbose=0)
        t2.learning_rate = 0.5


# --- errors ---------------------------------------------------------------------------------
def test_clear_errors():
    x, y = data(10)
    t = ls.Trainer(functional_mlp(), loss="sparse_categorical_crossentropy_from_logits")
    with pytest.raises(ValueError, match=r"`x` has 10, `y` has 9"):
        t.fit(x, y[:9], verbose=0)
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="validation_split"):
            t.fit(x, y, validation_split=bad, verbose=0)
    with pytest.raises(ValueError, match="loss='hinge_me'"):
        ls.Trainer(functional_mlp(), loss="hinge_me")
    with pytest.raises(ValueError, match="optimizer='adamax_plus'"):
        ls.Trainer(functional_mlp(), optimizer="adamax_plus")
    with pytest.raises(TypeError, match="model"):
        ls.Trainer(object())
    with pytest.raises(ValueError, match="batch_size"):
        t.evaluate(x, y, batch_size=0)


def test_keras_model_on_another_backend_is_refused():
    code = ("import keras, lockstep as ls\n"
            "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
            "try:\n    ls.Trainer(m)\nexcept ls.UsageError as e:\n    print('ERR', e)\n")
    env = {**os.environ, "KERAS_BACKEND": "numpy"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "ERR Keras runs on the 'numpy' backend, so a Keras model would train outside" in out.stdout, (
        out.stdout + out.stderr)
    assert "KERAS_BACKEND=jax" in out.stdout


def test_one_shot_iterators_lose_no_batch_and_fail_clearly_when_used_up():
    x, y = data(120)
    t = ls.Trainer(functional_mlp(), loss="sparse_categorical_crossentropy_from_logits", metrics=["accuracy"],
                   strategy=ls.MirroredStrategy(4))
    whole = t.evaluate(x, y, batch_size=120)
    one_shot = t.evaluate(iter([(x[i:i + 25], y[i:i + 25]) for i in range(0, 120, 25)]))
    assert one_shot["accuracy"] == whole["accuracy"]
    np.testing.assert_allclose(one_shot["loss"], whole["loss"], rtol=1e-6)
    gen = ((x[i:i + 30], y[i:i + 30]) for i in range(0, 120, 30))
    with pytest.raises(ValueError, match="no batch in epoch 2"):
        t.fit(gen, epochs=2, verbose=0)
    gen = ((x[i % 120:i % 120 + 30], y[i % 120:i % 120 + 30]) for i in range(0, 240, 30))
    hist = t.fit(gen, epochs=2, steps_per_epoch=4, verbose=0)  # one iterator continues across epochs
    assert hist.epoch == [0, 1]


def test_a_keras_model_built_in_a_scope_trains_on_that_strategy_outside_it():
    s = ls.MirroredStrategy(4)
    with s.scope():
        model = keras_mlp()
    assert {d.id for d in model.trainable_variables[0].value.sharding.device_set} == {0, 1, 2, 3}
    assert keras.distribution.distribution() is None  # Keras' distribution is restored on exit
    t = ls.Trainer(model)
    assert t.strategy is s
    with pytest.warns(UserWarning, match="runs on one device"):  # built outside: one device, said loudly
        assert ls.Trainer(keras_mlp()).strategy.num_replicas_in_sync == 1
    x, y = data(100)
    t.fit(x, y, batch_size=32, epochs=1, verbose=0)
    np.testing.assert_allclose(model.predict(x, verbose=0), t.predict(x), rtol=1e-5, atol=1e-6)


class _StopMidEpoch(ls.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.global_step == 5:
            raise KeyboardInterrupt


@pytest.mark.parametrize("r", [1, 3])
def test_a_state_taken_after_a_stopped_fit_whose_passes_numpy_draws_resumes_as_the_uninterrupted(r):
    """`fit(seed=None)` draws each pass from NumPy's global state (as Keras does). `train_state`
    taken after the fit stopped mid-pass holds where that state stood, so a new trainer restored
    from it (in a process seeded otherwise) trains that pass in the same order and goes on alike."""
    x, y = data()

    def fit(trainer, **kw):
        return trainer.fit(x, y, batch_size=64, epochs=2, seed=None, verbose=0, **kw).history

    def trainer():
        return ls.Trainer(functional_mlp(), loss="sparse_categorical_crossentropy_from_logits",
                          metrics=["accuracy"], strategy=ls.MirroredStrategy(r))
    np.random.seed(5)
    whole = trainer()
    want = fit(whole)
    np.random.seed(5)
    stopped = trainer()
    with pytest.raises(KeyboardInterrupt):
        fit(stopped, callbacks=[_StopMidEpoch()])
    state = stopped.train_state
    np.random.seed(99)
    resumed = trainer()
    resumed.evaluate(x[:8], y[:8], verbose=0)  # built (no draw: evaluate does not shuffle)
    resumed.restore(state)
    got = fit(resumed)
    np.testing.assert_allclose(got["loss"][-1], want["loss"][-1], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(resumed.get_weights()), jax.tree.leaves(whole.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_keras_free_trainer_drives_a_functional_model_as_lockstep_trainer_does_and_names_it_for_keras():
    """`lockstep.training.Trainer` (no Keras model adapter, no `compile` settings) trains a
    `FunctionalModel` to `lockstep.Trainer`'s weights (a last batch of 4 rows of 100 on 3
    replicas: one replica without rows); a Keras model is refused naming `lockstep.Trainer`; a loss
    per output is refused (a FunctionalModel's outputs have no names); a bad `steps_per_execution`
    is named before the model is read."""
    x, y = data()
    weights = []
    for trainer_class in (ls.training.Trainer, ls.Trainer):
        trainer = trainer_class(functional_mlp(), optimizer=optax.sgd(0.1),
                                loss="sparse_categorical_crossentropy_from_logits", strategy=ls.MirroredStrategy(3))
        trainer.fit(x[:100], y[:100], batch_size=12, epochs=2, verbose=0, seed=1)
        weights.append(trainer.get_weights())
    for a, b in zip(jax.tree.leaves(weights[0]), jax.tree.leaves(weights[1])):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"lockstep.Trainer \(lockstep.keras.Trainer\) takes Keras 3 models"):
        ls.training.Trainer(keras_mlp(), strategy=ls.MirroredStrategy(2))
    with pytest.raises(ValueError, match=r"`loss` is given per output \(dict\), but this model's outputs have no names"):
        ls.training.Trainer(functional_mlp(), loss={"a": "mse"}, strategy=ls.MirroredStrategy(2))
    with pytest.raises(ValueError, match=r"steps_per_execution=0"):
        ls.training.Trainer("not a model", steps_per_execution=0)
