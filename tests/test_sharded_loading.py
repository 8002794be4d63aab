"""Building and loading a sharded model places each variable straight into its shards: building
in a `ShardedStrategy`'s scope (each initialiser run by a program that writes each device's shard),
Keras' `load_weights` (`.weights.h5`), `keras.models.load_model` (`.keras`) and `set_weights` never
make a variable that the strategy splits whole on one device (Keras' JAX variables would put it on
the default device first), and the values are the initialiser's and the saved ones."""

import jax
import keras
import numpy as np
import pytest
from keras.src.backend.jax import distribution_lib

import lockstep as ls


def _model():
    return keras.Sequential([keras.Input((24,)), keras.layers.Dense(64, name="a"), keras.layers.Dense(40, name="b"),
                             keras.layers.Dense(3, name="c")])


@pytest.fixture
def whole_on_one_device(monkeypatch):
    """The values of variables that a sharded layout splits, given to Keras' `distribute_tensor`
    as a whole array on one device."""
    seen = []
    original = distribution_lib.distribute_tensor

    def spy(tensor, layout):
        sharding = getattr(layout, "backend_layout", layout)
        if (isinstance(sharding, jax.sharding.NamedSharding) and not sharding.is_fully_replicated
                and isinstance(tensor, jax.Array) and not isinstance(tensor, jax.core.Tracer)
                and len(tensor.sharding.device_set) == 1):
            seen.append(np.asarray(tensor))
        return original(tensor, layout)
    monkeypatch.setattr(distribution_lib, "distribute_tensor", spy)
    return seen


@pytest.mark.parametrize("how", ["load_weights", "load_model", "set_weights"])
def test_weights_go_from_the_host_straight_into_their_shards(tmp_path, whole_on_one_device, how):
    strategy = ls.ShardedStrategy(mesh=ls.DeviceMesh((8, 1), ("batch", "model")), zero_stage=3, min_shard_size=1,
                                  max_replicated_fraction=1.0)
    keras.utils.set_random_seed(1)
    saved = _model()  # built outside: its values are the reference, none of them an initialiser's
    rng = np.random.default_rng(0)
    saved.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in saved.get_weights()])
    saved.save_weights(tmp_path / "m.weights.h5")
    saved.save(tmp_path / "m.keras")
    want = [np.asarray(w) for w in saved.get_weights()]
    with strategy.scope():
        if how == "load_model":
            model = keras.models.load_model(tmp_path / "m.keras")
        else:
            model = _model()
            if how == "load_weights":
                model.load_weights(tmp_path / "m.weights.h5")
            else:
                model.set_weights(want)
    assert not whole_on_one_device  # neither an initialiser's value (building) nor a loaded one
    split = [v for v in model.weights if not v.value.sharding.is_fully_replicated]
    assert len(split) >= 4  # the kernels and biases that ZeRO-3 splits over the 8 devices
    for v in split:
        assert {s.data.size for s in v.value.addressable_shards} == {v.value.size // 8}
    for got, w in zip(model.get_weights(), want):
        np.testing.assert_array_equal(np.asarray(got), w)


@pytest.mark.parametrize("zero_stage,mesh", [(3, (8, 1)), (3, (4, 2)), (3, (2, 4))])
def test_building_in_the_scope_makes_each_shard_where_it_lies_with_keras_own_values(whole_on_one_device, zero_stage,
                                                                                    mesh):
    """The initial weights equal Keras' own (the same seed, built outside any scope), bit for bit."""
    keras.utils.set_random_seed(7)
    want = [np.asarray(w) for w in _model().get_weights()]
    strategy = ls.ShardedStrategy(mesh=ls.DeviceMesh(mesh, ("batch", "model")), zero_stage=zero_stage,
                                  min_shard_size=1, max_replicated_fraction=1.0)
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = _model()
    assert not whole_on_one_device
    assert any(not v.value.sharding.is_fully_replicated for v in model.weights)
    for got, w in zip(model.get_weights(), want):
        np.testing.assert_array_equal(np.asarray(got), w)
