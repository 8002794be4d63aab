"""Activation checkpointing (`Trainer(remat=...)`): the same numbers as the run without it, on
replicas (one of which holds no real row), on a ZeRO-3 sharded mesh, with dropout and
BatchNormalization; Keras' own `fit` is the reference."""

import keras
import numpy as np
import pytest

import lockstep as ls
from keras_reference import assert_equals_one_device, keras_fit

N, BATCH = 13, 8  # the last batch of 5 rows on 4 replicas: replica 3 holds none of them


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 6, 8)).astype("float32"), rng.integers(0, 3, N)


def _block():
    keras.utils.set_random_seed(1)
    inp = keras.Input((6, 8))
    h = keras.layers.MultiHeadAttention(2, 4)(inp, inp)
    h = keras.layers.LayerNormalization()(h + inp)
    h = keras.layers.Dense(16, activation="gelu")(h)
    h = keras.layers.BatchNormalization()(h)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out)


def _keras_fit(build=_block, batch_size=BATCH):
    """Keras' own one-device `fit` of `build()`'s model: the reference."""
    x, y = _data()
    return keras_fit(build, x, y, batch_size=batch_size, epochs=2,
                     compile=dict(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)))


@pytest.mark.parametrize("remat,strategy", [
    ("full", lambda: ls.MirroredStrategy(4)),
    ("layers", lambda: ls.MirroredStrategy(4)),
    ("dots", lambda: ls.ShardedStrategy(mesh=ls.DeviceMesh((4, 2), ("batch", "model")), zero_stage=3,
                                        min_shard_size=1, max_replicated_fraction=1.0)),
    ("nothing_saveable", lambda: ls.MirroredStrategy(2))])
def test_rematerialized_steps_equal_keras_own_fit(remat, strategy):
    x, y = _data()
    strategy = strategy()
    with strategy.scope():
        model = _block()
    trainer = ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits", remat=remat)
    history = trainer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    assert_equals_one_device((trainer.get_weights(), history), _keras_fit(), rtol=2e-5, atol=2e-6)


def test_dropout_draws_the_same_numbers_with_and_without_remat():
    """The recomputed forward pass draws the dropout masks the first one drew."""
    x, y = _data()
    runs = []
    for remat in (None, "layers"):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6, 8)), keras.layers.Flatten(), keras.layers.Dense(16),
                                  keras.layers.Dropout(0.5), keras.layers.Dense(3)])
        trainer = ls.Trainer(model, loss="sparse_categorical_crossentropy_from_logits",
                             strategy=ls.MirroredStrategy(4), remat=remat)
        trainer.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
        runs.append(trainer.get_weights())
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_layers_remat_keeps_fewer_bytes_in_the_step():
    """XLA's own accounting of the compiled step (`Trainer.step_memory`): less held with each
    layer's insides recomputed (on CPU the compiler keeps more than a GPU's would; see
    benchmarks/REMAT.md)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 32, 32)).astype("float32"), rng.integers(0, 3, 32)
    held = {}
    for remat in (None, "layers"):
        keras.utils.set_random_seed(1)
        inp = keras.Input((32, 32))
        h = inp
        for _ in range(3):
            h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 16)(h, h))
            h = keras.layers.Dense(32)(keras.layers.Dense(128, activation="gelu")(h))
        model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
        trainer = ls.Trainer(model, loss="sparse_categorical_crossentropy_from_logits", strategy=ls.MirroredStrategy(1),
                             remat=remat)
        assert trainer.step_memory() is None
        trainer.fit(x, y, batch_size=32, epochs=1, verbose=0)
        held[remat] = trainer.step_memory()
    assert held["layers"]["temporaries"] < held[None]["temporaries"]
    assert held["layers"]["arguments"] == held[None]["arguments"]


@pytest.mark.parametrize("bad", ["everything", 3, "save_dots"])
def test_an_unknown_remat_is_named(bad):
    with pytest.raises(ValueError, match=r"`remat` must be .* got remat="):
        ls.Trainer(_block(), remat=bad)


def _attention_block():
    """`_block` without BatchNormalization, which Keras' own `RematScope(mode="full")` cannot run
    (its call's `training` flag becomes a traced value: Keras' fit fails too, as with Dropout)."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((6, 8))
    h = keras.layers.LayerNormalization()(inp + keras.layers.MultiHeadAttention(2, 4)(inp, inp))
    h = keras.layers.Dense(16, activation="gelu")(h)
    return keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))


def test_keras_own_remat_scope_trains_as_written_and_is_rematerialized():
    """A model built under Keras' own `keras.RematScope(mode="full")` (the model's call and each
    layer's rematerialized, nested, by Keras) and trained by Keras' `model.fit` in a
    lockstep scope: Keras' one-device numbers without the scope, and the step lockstep compiles
    recomputes the forward pass (more FLOPs than the same model built without the scope; Keras'
    fit cannot build BatchNormalization or Dropout under that scope, so the model has neither)."""
    x, y = _data()
    with ls.MirroredStrategy(4).scope():
        with keras.RematScope(mode="full"):
            model = _attention_block()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    assert_equals_one_device((model.get_weights(), history), _keras_fit(_attention_block), rtol=2e-5, atol=2e-6)
    flops = {}
    for mode in ("full", None):
        with keras.RematScope(mode=mode):
            model = _attention_block()
        trainer = ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                             strategy=ls.MirroredStrategy(1))
        trainer.step_memory(x, y, batch_size=BATCH)  # compiles fit's first step, runs none
        flops[mode] = trainer.step_cost()["flops"]
    assert flops["full"] > flops[None] * 1.2, flops


@pytest.mark.parametrize("remat", ["full", "layers"])
def test_remat_with_several_steps_a_call_and_batch_normalization(remat):
    """Two programs of one checkpointed forward pass (runs of 4 and 3 steps a call: 7 batches of 2
    an epoch on 4 replicas, two of which hold no row) whose BatchNormalization reads the replica
    context's rows: each program its own trace (jax.checkpoint once kept the first's, and the
    second failed with an UnexpectedTracerError). Keras' own one-device fit is the reference."""
    x, y = _data()
    with ls.MirroredStrategy(4).scope():
        model = _block()
    trainer = ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits", remat=remat,
                         steps_per_execution=4)
    history = trainer.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0).history
    assert_equals_one_device((trainer.get_weights(), history), _keras_fit(batch_size=2), rtol=2e-5, atol=2e-6)
