"""The engine on a named mesh: the replicas lie along the mesh's batch axis, whatever other axes the
mesh has, and the face (`strategy.run` / `reduce` / `gather`, the `Trainer`) runs on it unchanged.

A mesh of 8 devices shaped (4, 2) as ("batch", "model") holds 4 replicas, each one's work done
alike on its 2 devices along "model": every number equals a 4-replica `MirroredStrategy`'s (the
same reductions, bit for bit) and one device's (float32 tolerance).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

import lockstep as ls
from lockstep.engine import Engine

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from common import assert_equals_one_device, data, keras_mlp  # noqa: E402
from common import model as mlp  # noqa: E402

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


def _fit_keras(strategy, n):
    x, y = data(n, seed=3)
    with strategy.scope():
        model = keras_mlp(batch_norm=True)
    trainer = ls.Trainer(model, optimizer=optax.adam(0.01), loss="sparse_categorical_crossentropy",
                         metrics=["accuracy", ls.metrics.F1Score(average="macro")], strategy=strategy)
    history = trainer.fit(x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0)
    return trainer.get_weights(), history.history


def _fit_functional(strategy, n):
    x, y = data(n, seed=5)
    trainer = ls.Trainer(mlp(), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                         metrics=["accuracy"], strategy=strategy, gradient_accumulation_steps=2)
    history = trainer.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return trainer.get_weights(), history.history


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("fit,n", [(_fit_keras, 61), (_fit_functional, 37)])
def test_fit_on_a_two_axis_mesh_equals_four_replicas_bit_for_bit_and_one_device(mesh, fit, n):
    """Keras BatchNorm (statistics over the global batch) with validation data, and accumulation;
    the last batches leave replicas without rows (61 = 3 * 16 + 13; 37 rows in batches of 8)."""
    def train(strategy):
        return fit(strategy, n)

    got = assert_equals_one_device(train, two_axis_strategy(*MESHES[mesh]))
    want = train(ls.MirroredStrategy(4))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_mesh_without_the_batch_axis_or_a_second_mesh_is_refused():
    mesh = Mesh(np.array(jax.devices()[:4], dtype=object).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="`batch_axis` 'batch' is not an axis of `mesh`.*'data', 'model'"):
        Engine(mesh=mesh)
    with pytest.raises(ValueError, match="either `devices`.*or `mesh`, not both"):
        Engine(jax.devices()[:2], mesh=mesh)
    with pytest.raises(ValueError, match="not neither"):
        Engine()
    assert Engine(mesh=mesh, batch_axis="data").num_replicas == 2
