"""Gradient accumulation: k batches of b per update equal one device's step on the k*b samples."""


import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest

import lockstep as ls

from common import N, data, keras_mlp  # noqa: E402  (the data and models the other tests use)
from common import model as mlp  # noqa: E402
from suite import variants  # noqa: E402

B, EPOCHS = 64, 2
X, Y = data(N)


def fit(model_kind, replicas, k, batch_size, **fit_kwargs):
    strategy = ls.MirroredStrategy(replicas)
    if model_kind == "functional":
        model = mlp()
    else:
        with strategy.scope():
            model = keras_mlp(seed=1, softmax=False)
    trainer = ls.Trainer(model, optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy_from_logits",
                         metrics=["accuracy"], strategy=strategy, gradient_accumulation_steps=k)
    history = trainer.fit(X, Y, batch_size=batch_size, epochs=EPOCHS, verbose=0, **fit_kwargs)
    return trainer, history


@pytest.mark.parametrize("model_kind", ["functional", "keras"])
@pytest.mark.parametrize("k", variants([1, 2, 4], {2, 4}))  # make test-full: k = 1 and 1 replica too
@pytest.mark.parametrize("replicas", variants([1, 4], {4}))
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
    model = keras.Sequential([keras.Input((X.shape[1],)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2),
                  loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2\)"):
        ls.Trainer(model, strategy=ls.MirroredStrategy(1))  # named: no order-dependent warning first


class _Interrupted(Exception):
    pass


class InterruptedBatches(ls.data.Batches):
    """Global batches that raise (as a killed worker stops) after `after` batches of epoch 1,
    read from the host or gathered on the devices (`fit`'s way with arrays that fit there)."""

    def __init__(self, after):
        super().__init__((X, Y), B, shuffle=True, seed=3, drop_remainder=False)
        self.after = after

    def _stopping(self, batches, epoch, start):
        for i, batch in enumerate(batches, start=start):
            if epoch == 1 and i == self.after:
                raise _Interrupted(f"stopped before batch {i} of epoch {epoch}")
            yield batch

    def rows(self, epoch, start=0):
        return self._stopping(super().rows(epoch, start), epoch, start)

    def resident_pass(self, engine, epoch, start=0, ahead=False):
        return self._stopping(super().resident_pass(engine, epoch, start, ahead), epoch, start)


def test_a_run_stopped_in_the_middle_of_a_group_resumes_from_the_last_update_exactly(tmp_path):
    """Backups land on update boundaries: stopped after 2 of a group's 4 batches, the resumed run
    redoes the whole group and ends where the uninterrupted run ends."""

    def trainer():
        return ls.Trainer(mlp(), optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy_from_logits",
                          metrics=["accuracy"], strategy=ls.MirroredStrategy(4), gradient_accumulation_steps=4)

    uninterrupted = trainer()
    want = uninterrupted.fit(ls.data.batches((X, Y), B, shuffle=True, seed=3), epochs=EPOCHS, verbose=0).history
    first = trainer()
    with pytest.raises(_Interrupted):
        first.fit(InterruptedBatches(after=6), epochs=EPOCHS, verbose=0,
                  callbacks=[ls.callbacks.BackupAndRestore(tmp_path, save_freq=1)])
    assert first.train_state.epoch == 1 and first.train_state.step == 1  # the last whole group of epoch 1
    resumed = trainer()
    got = resumed.fit(ls.data.batches((X, Y), B, shuffle=True, seed=3), epochs=EPOCHS, verbose=0,
                      callbacks=[ls.callbacks.BackupAndRestore(tmp_path, save_freq=1)]).history
    for a, b in zip(jax.tree.leaves(resumed.get_weights()), jax.tree.leaves(uninterrupted.get_weights())):
        np.testing.assert_array_equal(a, b)
    assert got == want


@pytest.mark.parametrize("replicas", variants([1, 3, 4], {3}))
def test_a_custom_loop_accumulates_exactly_with_accumulation_groups(replicas):
    """`ls.data.accumulation_groups` + `compute_average_loss(global_batch_size=group.num_samples)`:
    the custom loop's updates equal one device's steps on batches of 4 * 64."""
    model, opt = mlp(), optax.adam(0.01)

    def grads_of(params, batch, group_size):
        features, labels = batch

        def loss_fn(p):
            per_example = ls.losses.sparse_categorical_crossentropy(labels, model.apply(p, features), from_logits=True)
            return ls.compute_average_loss(per_example, global_batch_size=group_size)
        return jax.grad(loss_fn)(params)

    def train(strategy, batch_size, k):
        params = model.init(jax.random.key(0), X[:1])
        opt_state = opt.init(params)
        dist = strategy.experimental_distribute_dataset(ls.data.batches((X, Y), batch_size))
        for group in ls.data.accumulation_groups(dist, k):
            grads = None
            for batch in group.batches:
                g = strategy.experimental_local_results(
                    strategy.run(grads_of, args=(params, batch, group.num_samples)))[0]
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params

    got = train(ls.MirroredStrategy(replicas), B, 4)
    want = train(ls.OneDeviceStrategy(), 4 * B, 1)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("bad", [0, 2.0, None])
def test_accumulation_groups_names_a_bad_k(bad):
    with pytest.raises(ValueError, match="`k` must be a positive integer"):
        next(ls.data.accumulation_groups([], bad))


def bn_model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(2)
        return keras.Sequential([keras.Input((X.shape[1],)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                                 keras.layers.Activation("relu"), keras.layers.Dense(3)])


def test_batch_norm_normalises_each_batch_globally_and_moves_once_per_batch():
    """BatchNorm under accumulation: each batch of b is normalised by its own statistics over all
    replicas (so 4 replicas equal 1), and the moving averages advance once per batch (with a zero
    learning rate, they end where a plain run with batches of b leaves them)."""

    def run(replicas, k, lr):
        strategy = ls.MirroredStrategy(replicas)
        trainer = ls.Trainer(bn_model(strategy), optimizer=optax.sgd(lr),
                             loss="sparse_categorical_crossentropy_from_logits", strategy=strategy,
                             gradient_accumulation_steps=k)
        trainer.fit(X, Y, batch_size=B, epochs=1, verbose=0)
        return trainer.get_weights()

    for got, want in zip(run(4, 2, 0.1), run(1, 2, 0.1)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    frozen_accumulated, frozen_plain = run(4, 4, 0.0), run(1, 1, 0.0)
    for got, want in zip(frozen_accumulated, frozen_plain):  # moving mean / variance included
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert not np.allclose(frozen_plain[2 + 2], 0.0)  # the moving mean did move
