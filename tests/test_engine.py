"""The engine on a named mesh: the replicas lie along the mesh's batch axis, whatever other axes the
mesh has, and the face (`strategy.run` / `reduce` / `gather`, the `Trainer`) runs on it unchanged.

A mesh of 8 devices shaped (4, 2) as ("batch", "model") holds 4 replicas, each one's work done
alike on its 2 devices along "model": every number equals a 4-replica `MirroredStrategy`'s (the
same reductions, bit for bit) and an independent one-device run's (float32 tolerance): NumPy,
Keras' own `model.fit`, a hand-written JAX + optax loop.
"""


import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

import lockstep as ls
from lockstep.engine import Engine

from common import data, keras_mlp  # noqa: E402
from common import model as mlp  # noqa: E402
from keras_reference import assert_equals_one_device, keras_fit  # noqa: E402
from suite import variants  # noqa: E402

MESHES = {"batch x model": ((4, 2), ("batch", "model")), "model x batch": ((2, 4), ("model", "batch"))}


def two_axis_strategy(shape, names):
    devices = np.array(jax.devices()[:8], dtype=object).reshape(shape)
    return ls.Strategy(mesh=Mesh(devices, names, axis_types=(AxisType.Auto,) * 2), batch_axis="batch")


@pytest.mark.parametrize("mesh", MESHES)
def test_a_mesh_with_a_model_axis_holds_the_replicas_of_its_batch_axis(mesh):
    shape, names = MESHES[mesh]
    strategy = two_axis_strategy(shape, names)
    assert strategy.num_replicas_in_sync == 4
    assert len(strategy.extended.worker_devices) == 8
    assert strategy.extended.mesh.axis_names == names


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("n", [1, 3, 7, 64])
def test_run_reduce_and_gather_equal_four_mirrored_replicas(mesh, n):
    """7 rows on 4 replicas: 2 per replica, the last holds 1; 1 or 3 rows: some replicas hold none."""
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) ** 1.5

    def replica_fn(b):
        ctx = ls.get_replica_context()
        total = ctx.all_reduce("SUM", jnp.sum(b * ctx.mask[:, None], 0))
        mean = ctx.all_reduce("MEAN", jnp.sum(b * ctx.mask[:, None], 0) / jnp.maximum(jnp.sum(ctx.mask), 1))
        return b * 2.0, total, mean, ctx.replica_id_in_sync_group

    results = []
    for strategy in (two_axis_strategy(*MESHES[mesh]), ls.MirroredStrategy(4)):
        batch = next(iter(strategy.experimental_distribute_dataset([x])))
        doubled, total, mean, replica = strategy.run(replica_fn, args=(batch,))
        results.append([strategy.gather(doubled, axis=0), total, mean,
                        strategy.reduce("MEAN", doubled, axis=0), strategy.reduce("MAX", doubled, axis=0),
                        [int(r) for r in strategy.experimental_local_results(replica)]])
    got, want = results
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_allclose(np.asarray(got[0]), x * 2.0)  # padding rows never show
    np.testing.assert_allclose(np.asarray(got[1]), x.sum(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[3]), (x * 2.0).mean(0), rtol=1e-6)
    assert got[5] == [0, 1, 2, 3]


def _keras_fit(strategy, x, y):
    """Keras code as written: a BatchNorm MLP compiled and fitted with validation data, in
    `strategy`'s scope (lockstep runs it), or with no strategy (Keras' own one-device fit)."""
    return keras_fit(lambda: keras_mlp(batch_norm=True), x, y, strategy, batch_size=16, epochs=2, validation_split=0.25,
                     compile=lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                                          metrics=["accuracy"]))


@pytest.mark.parametrize("mesh", variants(list(MESHES), {"model x batch"}))
def test_keras_fit_on_a_two_axis_mesh_equals_four_replicas_bit_for_bit_and_keras_on_one_device(mesh):
    """BatchNorm's statistics over the global batch; 50 rows: 37 to train in batches of 16 (the
    last, 5 rows, leaves one replica empty), 13 to validate."""
    x, y = data(50, seed=3)
    got = _keras_fit(two_axis_strategy(*MESHES[mesh]), x, y)
    assert_equals_one_device(got, _keras_fit(None, x, y), rtol=2e-5, atol=1e-5)
    want = _keras_fit(ls.MirroredStrategy(4), x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _hand_written_adam(params, x, y, batch, epochs):
    """A jitted JAX + optax loop on one device: the weights and Keras-style epoch logs (the mean of
    each sample's loss and hit, taken with the weights of its step)."""
    model, opt = mlp(), optax.adam(0.01)
    state = opt.init(params)

    @jax.jit
    def step(params, state, xb, yb):
        def loss(p):
            per_sample = -jax.nn.log_softmax(model.apply(p, xb))[jnp.arange(len(yb)), yb]
            return per_sample.mean(), per_sample
        (_, per_sample), grads = jax.value_and_grad(loss, has_aux=True)(params)
        hits = model.apply(params, xb).argmax(-1) == yb
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, per_sample.sum(), hits.sum()

    logs = {"loss": [], "accuracy": []}
    for _ in range(epochs):
        loss_sum = hit_sum = 0.0
        for i in range(0, len(x), batch):
            params, state, l_sum, h_sum = step(params, state, x[i:i + batch], y[i:i + batch])
            loss_sum, hit_sum = loss_sum + float(l_sum), hit_sum + float(h_sum)
        logs["loss"].append(loss_sum / len(x))
        logs["accuracy"].append(hit_sum / len(x))
    return params, logs


@pytest.mark.parametrize("mesh", variants(list(MESHES), {"batch x model"}))
def test_accumulation_on_a_two_axis_mesh_equals_four_replicas_bit_for_bit_and_a_hand_written_loop(mesh):
    """Micro-batches of 8, two per update, on 4 replicas: 37 rows, so the last group is one
    micro-batch of 5 rows (one replica empty), as the hand loop's last batch of 5 is."""
    x, y = data(37, seed=5)
    runs = []
    for strategy in (two_axis_strategy(*MESHES[mesh]), ls.MirroredStrategy(4)):
        trainer = ls.Trainer(mlp(), optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy_from_logits",
                             metrics=["accuracy"], strategy=strategy, gradient_accumulation_steps=2)
        history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs.append((trainer.get_weights(), history.history))
    got, want = runs
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    start = mlp().init(jax.random.key(0), x[:1])  # the Trainer's initialisation (its `seed`, 0)
    assert_equals_one_device(got, _hand_written_adam(start, x, y, batch=16, epochs=2), rtol=2e-5, atol=2e-6)


def test_a_mesh_without_the_batch_axis_or_a_second_mesh_is_refused():
    mesh = Mesh(np.array(jax.devices()[:4], dtype=object).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="`batch_axis` 'batch' is not an axis of `mesh`.*'data', 'model'"):
        Engine(mesh=mesh)
    with pytest.raises(ValueError, match="one of `devices`.*and `mesh`, got both"):
        Engine(jax.devices()[:2], mesh=mesh)
    with pytest.raises(ValueError, match="one of `devices`.*and `mesh`, got neither"):
        Engine()
    assert Engine(mesh=mesh, batch_axis="data").num_replicas == 2
