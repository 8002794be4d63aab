"""Gradient accumulation: k batches of b per update equal one device's step on the k*b samples."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest

import lockstep as ls

N, B, EPOCHS = 1003, 64, 2
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 6)).astype(np.float32)
Y = (X[:, 0] + 0.5 * X[:, 1] ** 2 > 0.4).astype(np.int32) + (X[:, 2] > 1.0).astype(np.int32)


def mlp() -> ls.FunctionalModel:
    def init(key, x):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (x.shape[-1], 16)) * 0.3, "b1": jnp.zeros(16),
                "w2": jax.random.normal(k2, (16, 3)) * 0.3, "b2": jnp.zeros(3)}

    def apply(p, x, training=False):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return ls.FunctionalModel(init, apply)


def keras_mlp(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(3)])


def fit(model_kind, replicas, k, batch_size, **fit_kwargs):
    strategy = ls.MirroredStrategy(replicas)
    model = mlp() if model_kind == "functional" else keras_mlp(strategy)
    trainer = ls.Trainer(model, optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy_from_logits",
                         metrics=["accuracy"], strategy=strategy, gradient_accumulation_steps=k)
    history = trainer.fit(X, Y, batch_size=batch_size, epochs=EPOCHS, verbose=0, **fit_kwargs)
    return trainer, history


@pytest.mark.parametrize("model_kind", ["functional", "keras"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("replicas", [1, 4])
def test_k_batches_of_b_equal_one_device_with_batches_of_k_times_b(model_kind, k, replicas):
    reference, _ = fit(model_kind, 1, 1, k * B)
    trainer, history = fit(model_kind, replicas, k, B)
    for got, want in zip(jax.tree.leaves(trainer.get_weights()), jax.tree.leaves(reference.get_weights())):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert trainer.global_step == EPOCHS * -(-N // (k * B))  # optimizer steps, the short last group included
    # logs are running values over every sample seen: the epoch's loss is the mean of per-sample losses
    assert len(history.history["loss"]) == EPOCHS


def test_a_short_last_group_has_its_own_count():
    # 1003 = 5 groups of 3 x 64 + one group of 43: one device with batches of 192 sees the same groups
    reference, _ = fit("functional", 1, 1, 3 * B)
    trainer, _ = fit("functional", 3, 3, B)
    for got, want in zip(jax.tree.leaves(trainer.get_weights()), jax.tree.leaves(reference.get_weights())):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert trainer.global_step == EPOCHS * 6


def test_callbacks_see_optimizer_steps_and_logs_are_exact_running_values():
    seen = []

    class Steps(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, logs["loss"]))

    strategy = ls.MirroredStrategy(4)
    trainer = ls.Trainer(mlp(), optimizer=optax.sgd(0.0), loss="sparse_categorical_crossentropy_from_logits",
                         strategy=strategy, gradient_accumulation_steps=4)
    trainer.fit(X, Y, batch_size=B, epochs=1, verbose=0, shuffle=False, callbacks=[Steps()])
    assert [b for b, _ in seen] == [0, 1, 2, 3]
    # with a zero learning rate the weights never move: the running loss after group g is the mean
    # per-sample loss over the first g * 256 samples, which NumPy computes from the predictions
    logits = trainer.predict(X, batch_size=B)
    per_sample = -jax.nn.log_softmax(logits)[np.arange(N), Y]
    for g, (_, loss) in enumerate(seen):
        np.testing.assert_allclose(loss, np.mean(per_sample[:min((g + 1) * 4 * B, N)]), rtol=1e-5)


def test_steps_per_epoch_counts_optimizer_steps():
    trainer, _ = fit("functional", 2, 2, B, steps_per_epoch=3)
    assert trainer.global_step == EPOCHS * 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_accumulation_steps_are_named(bad):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        ls.Trainer(mlp(), gradient_accumulation_steps=bad)


def test_keras_optimizer_accumulation_points_to_the_trainer_argument():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2),
                  loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2\)"):
        ls.Trainer(model)
