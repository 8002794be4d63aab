"""Mixed precision: low-precision compute, float32 weights / optimizer state / metrics, and
dynamic loss scaling whose skip decision is the same on every replica."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest

import lockstep as ls
from suite import variants

N, B = 1003, 64
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 6)).astype(np.float32)
Y = (X[:, 0] + 0.5 * X[:, 1] ** 2 > 0.4).astype(np.int32) + (X[:, 2] > 1.0).astype(np.int32)


def mlp(seen_dtypes=None) -> ls.FunctionalModel:
    def init(key, x):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (x.shape[-1], 32)) * 0.3, "b1": jnp.zeros(32),
                "w2": jax.random.normal(k2, (32, 3)) * 0.3, "b2": jnp.zeros(3)}

    def apply(p, x, training=False):
        if seen_dtypes is not None:
            seen_dtypes.add((str(x.dtype), str(p["w1"].dtype), training))
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return ls.FunctionalModel(init, apply)


def float_leaves_dtypes(tree):
    return {str(np.asarray(a).dtype) for a in jax.tree.leaves(tree) if np.issubdtype(np.asarray(a).dtype, np.floating)}


def train_functional(policy, replicas=4, seen=None):
    trainer = ls.Trainer(mlp(seen), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                         metrics=["accuracy"], strategy=ls.MirroredStrategy(replicas), dtype_policy=policy)
    history = trainer.fit(X, Y, batch_size=B, epochs=3, verbose=0)
    return trainer, history


@pytest.mark.parametrize("policy, low", variants([("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")],
                                                 {("mixed_float16", "float16")}))
def test_a_functional_model_computes_low_and_keeps_float32_state(policy, low):
    seen = set()
    trainer, history = train_functional(policy, seen=seen)
    assert {(x, w) for x, w, training in seen if training} == {(low, low)}  # inputs and weights cast on entry
    assert float_leaves_dtypes(trainer.get_weights()) == {"float32"}
    assert float_leaves_dtypes(trainer.train_state.opt_state) == {"float32"}
    assert float_leaves_dtypes(trainer.train_state.metric_state) == {"float32"}
    assert trainer.predict(X[:5]).dtype == np.float32
    reference, ref_history = train_functional("float32")
    # stated tolerance: a 3-epoch MLP's loss within 0.02 and accuracy within 0.02 of float32's
    ours, theirs = trainer.evaluate(X, Y, batch_size=B), reference.evaluate(X, Y, batch_size=B)
    assert abs(ours["loss"] - theirs["loss"]) < 0.02, (ours, theirs)
    assert abs(ours["accuracy"] - theirs["accuracy"]) < 0.02, (ours, theirs)
    assert (low, low, False) in seen  # evaluate and predict computed low too
    if policy == "mixed_float16":
        assert history.history["skipped_steps"][-1] == 0
    else:
        assert "skipped_steps" not in history.history


def keras_trainer(policy):
    strategy = ls.MirroredStrategy(4)
    keras.config.set_dtype_policy(policy)
    try:
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    finally:
        keras.config.set_dtype_policy("float32")
    return model, ls.Trainer(model)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_keras_model_trains_under_its_own_dtype_policy(policy):
    model, trainer = keras_trainer(policy)
    assert model.layers[0].compute_dtype == policy.split("_")[1] and trainer.dtype_policy == policy
    history = trainer.fit(X, Y, batch_size=B, epochs=3, verbose=0)
    assert float_leaves_dtypes(trainer.get_weights()) == {"float32"}
    assert float_leaves_dtypes(trainer.train_state.opt_state) == {"float32"}
    _, reference = keras_trainer("float32")
    want = reference.fit(X, Y, batch_size=B, epochs=3, verbose=0).history
    # stated tolerance, as for the functional model: loss and accuracy within 0.02 of float32's
    np.testing.assert_allclose(history.history["loss"], want["loss"], atol=0.02)
    np.testing.assert_allclose(history.history["accuracy"], want["accuracy"], atol=0.02)


def test_a_dtype_policy_that_differs_from_the_keras_models_is_refused():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"set_dtype_policy\('mixed_bfloat16'\)"):
        ls.Trainer(model, dtype_policy="mixed_bfloat16", strategy=ls.OneDeviceStrategy())
    with pytest.raises(ValueError, match="dtype_policy"):
        ls.Trainer(mlp(), dtype_policy="float16")


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_non_finite_gradient_on_one_replica_skips_the_step_on_every_replica(accumulation):
    """Sample 3 * 64 + 40 (replica 2's rows of batch 3 on 4 replicas) overflows float16: that step's
    gradient is not finite after the all-reduce, so every replica keeps its weights and optimizer
    state, the loss scale halves, and the skip is counted."""
    x = X.copy()
    x[3 * B + 40, 0] = 1e6  # inf once cast to float16 (max 65504)
    weights = []

    class Record(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state = self.model.train_state  # lockstep callbacks' `model` is the trainer
            weights.append((jax.tree.map(np.asarray, state.params["trainable"]),
                            float(np.asarray(state.opt_state.scale)),
                            {float(np.asarray(s.data).ravel()[0]) for a in jax.tree.leaves(state.params["trainable"])
                             for s in a.addressable_shards[:1]}))
            per_device = [np.asarray(s.data) for s in state.params["trainable"]["w1"].addressable_shards]
            assert all(np.array_equal(per_device[0], d) for d in per_device)  # replicas agree

    trainer = ls.Trainer(mlp(), optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy_from_logits",
                         strategy=ls.MirroredStrategy(4), dtype_policy="mixed_float16",
                         gradient_accumulation_steps=accumulation)
    history = trainer.fit(x, Y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[Record()])
    poisoned = 3 // accumulation  # the optimizer step holding batch 3
    before, after = weights[poisoned - 1], weights[poisoned]
    jax.tree.map(np.testing.assert_array_equal, after[0], before[0])  # the step was skipped
    assert after[1] == before[1] / 2  # the scale halved
    changed = weights[poisoned + 1]
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(changed[0]), jax.tree.leaves(after[0])))
    assert history.history["skipped_steps"] == [1]
    assert trainer.train_state.opt_state.skipped == 1


def test_loss_scaling_skips_and_grows_like_keras():
    from lockstep.training._precision import with_loss_scaling

    opt = with_loss_scaling(optax.sgd(1.0), initial_scale=8.0, growth_steps=2)
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    scales = []
    for g in ([1.0, 1.0], [1.0, 1.0], [np.nan, 0.0], [1.0, 1.0]):
        updates, state = opt.update({"w": jnp.asarray(g)}, state, params)
        scales.append(float(state.scale))
        if not np.isfinite(g).all():
            assert float(jnp.abs(updates["w"]).sum()) == 0.0
    assert scales == [8.0, 16.0, 8.0, 8.0] and int(state.skipped) == 1
