"""Keras models as users bring them: every layer family trains on 1, 2 and 4 replicas and a step
equals the single-device step (deterministic layers); stochastic layers draw per replica."""

import contextlib

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest

import lockstep as ls
from lockstep.keras import KerasModel
from keras_reference import assert_logs_close, assert_weights_close, in_keras_and_lockstep, keras_fit
from suite import variants

L = keras.layers
N, BATCH = 21, 8  # 3 steps an epoch, the last of 5 rows: on 4 replicas one holds no real row


def _seq(n=N, t=6, c=3, seed=0):
    return np.random.default_rng(seed).normal(size=(n, t, c)).astype(np.float32)


def _img(n=N, h=6, w=6, c=2, seed=0):
    return np.random.default_rng(seed).normal(size=(n, h, w, c)).astype(np.float32)


def _tokens(n=N, t=7, vocab=12, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(1, vocab, size=(n, t))
    lengths = rng.integers(2, t + 1, size=n)
    tok[np.arange(t)[None, :] >= lengths[:, None]] = 0  # variable lengths, zero-padded
    return tok.astype(np.int32)


def _labels(x, classes=3):
    flat = np.asarray(x, np.float32).reshape(len(x), -1)
    return (np.abs(flat[:, :5].sum(1) * 3).astype(np.int64) % classes).astype(np.int32)


def _seq_masked():
    x = _seq()
    x[np.arange(x.shape[1])[None, :] >= np.random.default_rng(1).integers(2, 7, size=N)[:, None]] = 0.0
    return x


def _functional(inputs, outputs):
    return keras.Model(inputs, outputs)


def _return_state():
    inp = keras.Input((6, 3))
    seq, h, c = L.LSTM(4, return_sequences=True, return_state=True)(inp)
    return _functional(inp, L.Dense(3)(L.Concatenate()([L.GlobalAveragePooling1D()(seq), h, c])))


def _mha():
    inp = keras.Input((6, 3))
    att = L.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
    return _functional(inp, L.Dense(3)(L.Flatten()(att)))


def _dot_attention():
    inp = keras.Input((6, 3))
    q, v = L.Dense(4)(inp), L.Dense(4)(inp)
    return _functional(inp, L.Dense(3)(L.GlobalAveragePooling1D()(L.Attention()([q, v]))))


def _merge():
    inp = keras.Input((6, 3))
    a, b = L.Dense(4)(inp), L.Dense(4, activation="tanh")(inp)
    merged = L.Concatenate()([L.Add()([a, b]), L.Multiply()([a, b]), L.Subtract()([a, b]), L.Maximum()([a, b])])
    return _functional(inp, L.Dense(3)(L.Flatten()(merged)))


def _seq_model(layers, shape=(6, 3)):
    return lambda: keras.Sequential([keras.Input(shape), *layers(), L.Dense(3)])


# name -> (model factory, inputs); every factory builds its layers after the seed is set
DETERMINISTIC = {
    # recurrent
    "SimpleRNN": (_seq_model(lambda: [L.SimpleRNN(4)]), _seq),
    "GRU": (_seq_model(lambda: [L.GRU(4)]), _seq),
    "LSTM": (_seq_model(lambda: [L.LSTM(4)]), _seq),
    "stacked LSTM": (_seq_model(lambda: [L.LSTM(4, return_sequences=True), L.LSTM(4)]), _seq),
    "Bidirectional LSTM": (_seq_model(lambda: [L.Bidirectional(L.LSTM(4))]), _seq),
    "LSTM go_backwards": (_seq_model(lambda: [L.LSTM(4, go_backwards=True)]), _seq),
    "GRU sequences": (_seq_model(lambda: [L.GRU(4, return_sequences=True), L.GlobalAveragePooling1D()]), _seq),
    "RNN custom cells": (_seq_model(lambda: [L.RNN(L.StackedRNNCells([L.SimpleRNNCell(4), L.GRUCell(3)]))]), _seq),
    "LSTM return_state": (_return_state, _seq),
    "ConvLSTM1D": (_seq_model(lambda: [L.ConvLSTM1D(2, 3), L.Flatten()], shape=(3, 5, 2)),
                   lambda: _seq(t=3).repeat(2, axis=2)[:, :, :5, None].repeat(2, axis=3)),
    "ConvLSTM2D": (_seq_model(lambda: [L.ConvLSTM2D(2, 2), L.Flatten()], shape=(3, 4, 4, 2)),
                   lambda: _img(h=4, w=4, c=6).reshape(N, 4, 4, 3, 2).transpose(0, 3, 1, 2, 4)),
    "Embedding mask_zero LSTM": (_seq_model(lambda: [L.Embedding(12, 4, mask_zero=True), L.LSTM(4)], shape=(7,)),
                                 _tokens),
    "Masking GRU": (_seq_model(lambda: [L.Masking(0.0), L.GRU(4)]), _seq_masked),
    # normalisation
    "BatchNormalization dense": (_seq_model(lambda: [L.Flatten(), L.Dense(8), L.BatchNormalization(),
                                                     L.Activation("relu")]), _seq),
    "BatchNormalization conv": (_seq_model(lambda: [L.Conv2D(3, 3), L.BatchNormalization(), L.ReLU(), L.Flatten()],
                                           shape=(6, 6, 2)), _img),
    "BatchNormalization masked LSTM": (_seq_model(lambda: [L.Masking(0.0), L.BatchNormalization(), L.LSTM(4)]),
                                       _seq_masked),
    "LayerNormalization": (_seq_model(lambda: [L.LayerNormalization(), L.Flatten()]), _seq),
    "GroupNormalization": (_seq_model(lambda: [L.Conv2D(4, 3), L.GroupNormalization(2), L.Flatten()],
                                      shape=(6, 6, 2)), _img),
    "UnitNormalization": (_seq_model(lambda: [L.Flatten(), L.UnitNormalization()]), _seq),
    # convolution
    "Conv1D": (_seq_model(lambda: [L.Conv1D(4, 3, padding="same"), L.Flatten()]), _seq),
    "Conv2D": (_seq_model(lambda: [L.Conv2D(4, 3, strides=2), L.Flatten()], shape=(6, 6, 2)), _img),
    "DepthwiseConv2D": (_seq_model(lambda: [L.DepthwiseConv2D(3), L.Flatten()], shape=(6, 6, 2)), _img),
    "SeparableConv2D": (_seq_model(lambda: [L.SeparableConv2D(4, 3), L.Flatten()], shape=(6, 6, 2)), _img),
    "Conv2DTranspose": (_seq_model(lambda: [L.Conv2DTranspose(2, 3, strides=2), L.Flatten()], shape=(6, 6, 2)),
                        _img),
    "Conv1DTranspose": (_seq_model(lambda: [L.Conv1DTranspose(2, 3), L.Flatten()]), _seq),
    # pooling
    "MaxPooling2D AveragePooling2D": (_seq_model(lambda: [L.MaxPooling2D(2), L.AveragePooling2D(1), L.Flatten()],
                                                 shape=(6, 6, 2)), _img),
    "GlobalMaxPooling1D": (_seq_model(lambda: [L.Conv1D(4, 2), L.GlobalMaxPooling1D()]), _seq),
    # attention
    "MultiHeadAttention": (_mha, _seq),
    "Attention": (_dot_attention, _seq),
    # embedding
    "Embedding": (_seq_model(lambda: [L.Embedding(12, 3), L.Flatten()], shape=(7,)), _tokens),
    # reshaping and merging
    "Reshape Permute": (_seq_model(lambda: [L.Permute((2, 1)), L.Reshape((9, 2)), L.Flatten()]), _seq),
    "RepeatVector TimeDistributed": (_seq_model(lambda: [L.Flatten(), L.RepeatVector(2),
                                                         L.TimeDistributed(L.Dense(2)), L.Flatten()]), _seq),
    "Cropping ZeroPadding UpSampling": (_seq_model(lambda: [L.Cropping2D(1), L.ZeroPadding2D(1), L.UpSampling2D(2),
                                                            L.Flatten()], shape=(6, 6, 2)), _img),
    "merge layers": (_merge, _seq),
    # regularisation (counted once per step, not once per replica)
    "kernel_regularizer ActivityRegularization": (
        _seq_model(lambda: [L.Flatten(), L.Dense(5, kernel_regularizer=keras.regularizers.l2(0.1)),
                            L.ActivityRegularization(l1=0.01)]), _seq),
}


def _build(factory, seed=0):
    keras.utils.set_random_seed(seed)
    return factory()


def _compile_kw():
    """How the Keras-reference tests compile: SGD(0.05), a cross-entropy on logits."""
    return dict(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _compiled(model):
    """`model` compiled as the Keras-reference tests train it (`_compile_kw`)."""
    model.compile(**_compile_kw())
    return model


def _assert_fits_as_keras_on_one_device(factory, x, y, batch_size, strategies, name):
    """Keras' `fit` of `factory()` in each strategy's scope (2 epochs in order) gives Keras' own
    one-device weights."""
    def weights(strategy):  # built, compiled and fitted in the scope
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            return keras_fit(factory, x, y, seed=0, compile=_compile_kw, batch_size=batch_size, epochs=2)[0]
    want = weights(None)
    for strategy in strategies:
        for a, b in zip(want, weights(strategy)):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6, err_msg=f"{name} on {strategy}")


def _fit(factory, x, y, replicas, epochs=2):
    t = ls.Trainer(_build(factory), optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(replicas))
    t.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, seed=3)
    return t


# make test trains these (one of each family users bring most); make test-full trains every entry
IN_MAKE_TEST = {"Dropout", "LSTM dropout recurrent_dropout", "Bidirectional LSTM", "BatchNormalization conv",
                "BatchNormalization masked LSTM", "MultiHeadAttention"}


def _names(table):
    return [name if name in IN_MAKE_TEST else pytest.param(name, marks=pytest.mark.full_suite) for name in sorted(table)]


@pytest.mark.parametrize("name", _names(DETERMINISTIC))
def test_deterministic_model_trains_like_one_device_on_2_and_4_replicas(name):
    factory, inputs = DETERMINISTIC[name]
    x = inputs()
    y = _labels(x)
    reference = _fit(factory, x, y, 1)
    expected = reference.get_weights()
    assert all(np.isfinite(w).all() for w in expected)
    for r in (2, 4):
        t = _fit(factory, x, y, r)
        for a, b in zip(expected, t.get_weights()):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6, err_msg=f"{name} on {r} replicas")
    np.testing.assert_allclose(t.predict(x, batch_size=BATCH), reference.predict(x, batch_size=BATCH),
                               rtol=2e-5, atol=2e-6)


def test_the_zoo_covers_the_layer_families():
    assert len(DETERMINISTIC) + len(STOCHASTIC) >= 35


def test_batch_norm_equals_keras_own_fit_and_its_moving_statistics():
    x = _seq().reshape(N, -1) * 3 + 1
    y = _labels(x)

    def factory():
        return keras.Sequential([keras.Input((18,)), L.Dense(8), L.BatchNormalization(), L.ReLU(), L.Dense(3)])

    km = _build(factory)
    km.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    km.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    t = ls.Trainer(_build(factory), optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(4))
    t.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(km.get_weights(), t.get_weights()):  # moving mean and variance included
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    # per-replica statistics are the explicit opt-out: the step then depends on the split
    p = ls.Trainer(_build(factory), optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(4), batch_statistics="per_replica")
    p.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    assert max(float(np.abs(a - b).max()) for a, b in zip(km.get_weights(), p.get_weights())) > 1e-3
    with pytest.raises(ValueError, match="batch_statistics"):
        ls.Trainer(_build(factory), batch_statistics="sync", strategy=ls.MirroredStrategy(1))


@pytest.mark.parametrize("replicas", variants([1, 3, 4], {3}))
def test_regularisers_count_once_and_log_as_keras_does(replicas):
    """Weight and activity penalties: the step, the logged loss and `evaluate` equal Keras' own,
    though the last batch (5 rows) leaves padding rows and an empty replica."""
    x = _seq().reshape(N, -1)
    y = _labels(x)

    def factory():
        return keras.Sequential([
            keras.Input((18,)),
            L.Dense(8, kernel_regularizer=keras.regularizers.l2(0.5), activity_regularizer=keras.regularizers.l1(0.3)),
            L.ActivityRegularization(l2=0.5), L.Dense(3, bias_regularizer=keras.regularizers.l1(0.2))])

    km = _build(factory)
    km.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    want = km.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False).history["loss"]
    t = ls.Trainer(_build(factory), optimizer=optax.sgd(0.05), loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(replicas))
    got = t.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(km.get_weights(), t.get_weights()):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(t.evaluate(x, y, batch_size=BATCH)["loss"],
                               km.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)


def test_an_activity_regulariser_of_unknown_form_is_warned_about():
    def factory():
        return keras.Sequential([keras.Input((4,)), L.Dense(3, activity_regularizer=lambda a: keras.ops.max(a))])

    with pytest.warns(UserWarning, match="activity_regularizer of type function"):
        ls.Trainer(_build(factory), strategy=ls.OneDeviceStrategy())  # named: no warning of a recent scope's


@pytest.mark.parametrize("replicas", variants([1, 3, 4], {3}))
def test_recurrent_layers_in_a_custom_loop_with_strategy_run(replicas):
    """`strategy.run` (replication typing on): a scan whose carry starts as replicated zeros and
    becomes per replica traces; the gradient is the one-device gradient, summed by JAX."""
    s = ls.MirroredStrategy(replicas)
    with s.scope():
        model = _build(lambda: keras.Sequential([keras.Input((6, 3)), L.Bidirectional(L.LSTM(4, return_sequences=True)),
                                                 L.GRU(3), L.Dense(1)]))
    x = _seq(n=10)
    tv = [np.asarray(v.value) for v in model.trainable_variables]
    ntv = [np.asarray(v.value) for v in model.non_trainable_variables]

    def loss(tv, xb, average):
        y, _ = model.stateless_call(tv, ntv, xb, training=True)
        return average(jnp.sum(y ** 2, axis=-1))

    def step(tv, xb):
        return jax.grad(loss)(tv, xb, ls.compute_average_loss)

    batch = next(iter(s.experimental_distribute_dataset(ls.data.batches(x, 10))))
    grads = s.run(step, args=(tv, batch))
    want = jax.grad(loss)(tv, x, jnp.mean)
    for g, w in zip(grads, want):
        assert isinstance(g, ls.Mirrored)
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6)


def test_a_stateful_recurrent_layer_is_refused_by_name():
    model = keras.Sequential([keras.Input((5, 3), batch_size=8), L.LSTM(4, stateful=True, name="memory"), L.Dense(2)])
    with pytest.raises(ValueError, match="layer 'memory' \\(LSTM\\) is stateful"):
        ls.Trainer(model, strategy=ls.MirroredStrategy(2))


def test_none_time_dimension_with_batches_of_different_lengths():
    def factory():
        return keras.Sequential([keras.Input((None, 3)), L.Masking(0.0), L.LSTM(4), L.Dense(3)])

    rng = np.random.default_rng(0)
    batches = []
    for n, t in ((8, 4), (8, 7), (5, 5)):
        xb = rng.normal(size=(n, t, 3)).astype(np.float32)
        batches.append((xb, _labels(xb)))
    weights = {}
    for r in (1, 4):
        tr = ls.Trainer(_build(factory), optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
                        strategy=ls.MirroredStrategy(r))
        tr.fit(batches, epochs=2, verbose=0)
        weights[r] = tr.get_weights()
    for a, b in zip(weights[1], weights[4]):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


STOCHASTIC = {
    "Dropout": lambda: [L.Flatten(), L.Dense(6), L.Dropout(0.5)],
    "SpatialDropout1D": lambda: [L.Conv1D(4, 2), L.SpatialDropout1D(0.5), L.Flatten()],
    "GaussianNoise": lambda: [L.Flatten(), L.GaussianNoise(1.0)],
    "GaussianDropout": lambda: [L.Flatten(), L.GaussianDropout(0.5)],
    "AlphaDropout": lambda: [L.Flatten(), L.AlphaDropout(0.5)],
    "LSTM dropout recurrent_dropout": lambda: [L.LSTM(4, dropout=0.5, recurrent_dropout=0.5, return_sequences=True),
                                               L.Flatten()],
    "RandomFlip": lambda: [L.Reshape((6, 3, 1)), L.RandomFlip("horizontal_and_vertical"), L.Flatten()],
}


def _per_replica_training_outputs(model, x, replicas):
    """The model's training-mode outputs on each replica for the same rows on every replica."""
    s = ls.MirroredStrategy(replicas)
    adapter = KerasModel(model)
    params = adapter.build(x[:1])
    batch = next(iter(s.experimental_distribute_dataset([np.concatenate([x] * replicas)])))
    out = s.extended.run_arrays(lambda p, d: adapter.apply(p, d, True)[0], (params, batch.data),
                                ("replicated", "rows"), "per_replica", mask=batch.mask, count=batch.count,
                                check_vma=False)
    return np.asarray(out)


@pytest.mark.parametrize("name", _names(STOCHASTIC))
def test_stochastic_layers_draw_per_replica_and_repeat_for_a_seed(name):
    def factory():
        return keras.Sequential([keras.Input((6, 3)), *STOCHASTIC[name](), L.Dense(3)])

    x = _seq(n=4)
    out = _per_replica_training_outputs(_build(factory), x, 4)
    assert out.shape[0] == 4
    for r in range(1, 4):  # the same rows, another replica: another draw
        assert not np.allclose(out[0], out[r]), f"{name}: replica {r} drew replica 0's randomness"
    np.testing.assert_array_equal(out, _per_replica_training_outputs(_build(factory), x, 4))
    y = _labels(_seq())
    first = _fit(factory, _seq(), y, 4, epochs=1).get_weights()
    again = _fit(factory, _seq(), y, 4, epochs=1).get_weights()
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", _names(STOCHASTIC))
def test_stochastic_layers_train_as_keras_own_fit_draws_on_one_device(name):
    """A Keras model's dropout masks, noise and random augmentation are drawn for the global batch,
    each replica taking its rows: on 3 and 4 replicas (a last batch of 5 rows leaves padding and an
    empty replica), and ZeRO-3 on a 4 x 2 mesh, the weights are those of Keras' own one-device `fit`
    with the same seed. Before, each replica drew its own (the same statistics, another step)."""
    def factory():
        return keras.Sequential([keras.Input((6, 3)), *STOCHASTIC[name](), L.Dense(3)])

    x = _seq()
    zero_3 = ls.ShardedStrategy(mesh=ls.DeviceMesh((4, 2), ("batch", "model")), zero_stage=3, min_shard_size=1,
                                max_replicated_fraction=1.0)
    _assert_fits_as_keras_on_one_device(factory, x, _labels(x), BATCH,
                                        (ls.MirroredStrategy(3), ls.MirroredStrategy(4), zero_3), name)


def test_functional_model_gets_a_key_per_replica_and_step():
    seen = []

    def apply(params, x, training=False, rng=None):
        seen.append(rng)
        keep = jax.random.bernoulli(rng, 0.5, x.shape) if training else jnp.ones(x.shape, bool)
        return jnp.where(keep, x, 0.0) @ params["w"]

    model = ls.FunctionalModel(lambda rng, x: {"w": jnp.ones((x.shape[-1], 2))}, apply)
    x = np.ones((8, 5), np.float32)
    y = np.zeros(8, np.int32)
    s = ls.MirroredStrategy(4)
    t = ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits", strategy=s)
    t.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert seen and all(k is not None for k in seen)
    assert int(t.train_state.params["non_trainable"]["rng_step"]) == 1  # one training step drew once
    synced = []
    t.sync_model = lambda: synced.append(1)
    t.evaluate(x, y, batch_size=8), t.predict(x, batch_size=8)  # inference leaves the counter as it is: nothing
    assert int(t.train_state.params["non_trainable"]["rng_step"]) == 1 and not synced  # returned, nothing to sync


def test_a_replicas_rows_of_a_draw_are_drawn_from_its_first_counter_as_one_device_draws_them():
    """`normal`, `uniform`, `truncated_normal` and `bernoulli` (dropout) on a replica's key give its
    rows of the global batch's draw, in float32, bfloat16 and float16; the first counter is
    replica x rows x row size in 64 bits (past 2**32 too)."""
    from lockstep.keras._layers import _Rows

    seed, replicas, rows, width = jnp.array([0, 42], jnp.uint32), 4, 3, 5
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        draws = {"normal": lambda k, s: jax.random.normal(k, s, dtype),
                 "uniform": lambda k, s: jax.random.uniform(k, s, dtype, 0.2, 0.9),
                 "truncated_normal": lambda k, s: jax.random.truncated_normal(k, -2.0, 2.0, s, dtype),
                 "bernoulli": lambda k, s: jax.random.bernoulli(k, 0.7, s)}
        for name, draw in draws.items():
            everyone = np.asarray(draw(seed, (replicas * rows, width)))
            for r in range(replicas):
                mine = np.asarray(draw(_Rows(rows, replicas, jnp.int32(r)).key(seed, width), (rows, width)))
                np.testing.assert_array_equal(mine, everyone[r * rows:(r + 1) * rows], err_msg=f"{name} {dtype}")
    for replica, per_row in ((7, 10**6), (1, 2**13)):
        words = np.asarray(jax.random.key_data(_Rows(3000, 8, jnp.int32(replica)).key(seed, per_row)), np.uint64)
        assert int(words[2]) * 2**32 + int(words[3]) == replica * 3000 * per_row


ROWS_OR_NOT = {  # a draw whose length is a replica's rows, for every row (left) or one for the batch (right)
    "Dropout noise_shape=(1, 6)": lambda: [L.Flatten(), L.Dense(6), L.Dropout(0.5, noise_shape=(1, 6))],
    "SpatialDropout1D": lambda: [L.Conv1D(4, 2), L.SpatialDropout1D(0.5), L.Flatten()],
    "both": lambda: [L.Conv1D(4, 2), L.SpatialDropout1D(0.5), L.Flatten(), L.Dense(6),
                     L.Dropout(0.5, noise_shape=(1, 6))],
}


@pytest.mark.parametrize("name", list(ROWS_OR_NOT))
def test_a_draw_as_long_as_a_replicas_rows_follows_them_only_where_it_follows_the_batch(name):
    """With one row on each replica, `Dropout(noise_shape=(1, 6))` draws one mask of one row for
    the whole batch and `SpatialDropout1D` one for each row: alike in length, told apart by tracing
    the model at two batch sizes (before, both were taken for rows, so each replica drew its own
    shared mask). Batches of 4 on 4 replicas, 13 rows (a last batch of one row: three replicas
    without rows), against Keras' own one-device `fit`."""
    def factory():
        return keras.Sequential([keras.Input((6, 3)), *ROWS_OR_NOT[name](), L.Dense(3)])

    x = _seq(n=13)
    _assert_fits_as_keras_on_one_device(factory, x, _labels(x), 4, (ls.MirroredStrategy(4),), name)


def _jax_dropout(params, rng, inputs, training):
    if training:
        inputs = jnp.where(jax.random.bernoulli(rng, 0.5, inputs.shape), inputs * 2.0, 0.0)
    return inputs @ params["w"]


def _jax_dense(params, rng, inputs, training):  # takes an rng (as every FlaxLayer's function does), draws nothing
    return inputs @ params["w"]


def _jax_layer(call_fn):
    return keras.layers.JaxLayer(call_fn, init_fn=lambda rng, inputs: {"w": jnp.ones((3, 2)) * 0.3})


REFUSED_DRAWS = {  # what a replica cannot draw as one device does, and the error's words
    "MixUp": (lambda: [L.Reshape((6, 3, 1)), L.MixUp(seed=1), L.Flatten()], "keras.random.shuffle permutes"),
    "CutMix": (lambda: [L.Reshape((6, 3, 1)), L.CutMix(seed=1), L.Flatten()], "keras.random.shuffle permutes"),
    "JaxLayer drawing with its rng": (lambda: [_jax_layer(_jax_dropout), L.Flatten()], "draws with the `rng`"),
}


@pytest.mark.filterwarnings("ignore:(?s).*Explicitly requested dtype int64")  # Keras' MixUp and CutMix on JAX
@pytest.mark.parametrize("name", list(REFUSED_DRAWS))
def test_draws_a_replica_cannot_make_as_one_device_are_refused_on_several_replicas(name):
    """MixUp and CutMix mix each row with another row of the whole batch (`keras.random.shuffle`),
    and a `JaxLayer`'s function draws with its own `rng`: a replica, holding only its rows, cannot
    draw either as one device does. On 2 replicas Keras' `fit` in a scope raises a clear error
    (before: each replica mixed its own rows, or drew one mask for its rows, silently another
    step); `predict` there gives Keras' own outputs; on one replica `fit` gives Keras' own
    one-device weights."""
    layers, words = REFUSED_DRAWS[name]

    def factory():
        return keras.Sequential([keras.Input((6, 3)), *layers(), L.Dense(3)])

    x = _seq(n=13)
    y = _labels(x)
    _assert_fits_as_keras_on_one_device(factory, x, y, 4, (ls.MirroredStrategy(1),), name)
    want_outputs = _compiled(_build(factory)).predict(x, verbose=0)
    with ls.MirroredStrategy(2).scope():
        two = _compiled(_build(factory))
        np.testing.assert_allclose(two.predict(x, verbose=0), want_outputs, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=words):
            two.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)


def test_a_jax_layer_that_takes_an_rng_without_drawing_trains_as_keras_own_fit():
    """A `JaxLayer` whose function takes an `rng` (as every `FlaxLayer`'s does) but draws nothing
    with it is not refused: on 3 replicas (13 rows in batches of 4: padding, replicas without rows)
    Keras' `fit` in a scope gives Keras' own one-device weights."""
    def factory():
        return keras.Sequential([keras.Input((6, 3)), _jax_layer(_jax_dense), L.Flatten(), L.Dense(3)])

    x = _seq(n=13)
    _assert_fits_as_keras_on_one_device(factory, x, _labels(x), 4, (ls.MirroredStrategy(3),), "JaxLayer")


# --- losses over time steps: Keras loss objects, Keras masks (Embedding(mask_zero=True)), ignore_class ----------
_T, _V = 6, 10
_seq_rng = np.random.default_rng(4)
_TOKENS = _seq_rng.integers(1, _V, size=(13, _T))
for _i in range(13):  # padded sequences: token 0, which Embedding(mask_zero=True) masks
    _TOKENS[_i, _seq_rng.integers(2, _T):] = 0
_TAGS = _seq_rng.integers(0, 3, size=(13, _T))


def _tagger(mask_zero, loss, metrics=None):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((_T,), dtype="int32"), keras.layers.Embedding(_V, 4, mask_zero=mask_zero),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss(), metrics=metrics and metrics())
        return model
    return build


@pytest.mark.parametrize("case", ["object", "masked", "ignore_class"])
@pytest.mark.parametrize("replicas, batch_size", [(1, 13), (3, 4), (8, 3)])
def test_a_loss_over_time_steps_equals_keras_with_its_masks(case, replicas, batch_size):
    """A Keras loss object on a per-time-step output: lockstep summed the steps' losses where Keras
    averages them (the gradient 6x Keras' on 6 steps); the mask an Embedding(mask_zero=True) leaves
    on the output, and the loss's own ignore_class, were not applied (the mean over every step, for
    Keras' over the unmasked ones, normalised per batch). Now each equals Keras' own evaluate and
    fit (weights too), with the step's rows and unmasked steps counted over every replica."""
    build = {"object": _tagger(False, keras.losses.SparseCategoricalCrossentropy),
             "masked": _tagger(True, keras.losses.SparseCategoricalCrossentropy,
                               lambda: [keras.metrics.SparseCategoricalAccuracy(name="acc")]),
             "ignore_class": _tagger(False, lambda: keras.losses.SparseCategoricalCrossentropy(ignore_class=1))}[case]

    def run(model):
        evaluated = model.evaluate(_TOKENS, _TAGS, batch_size=batch_size, verbose=0, return_dict=True)
        return evaluated, model.fit(_TOKENS, _TAGS, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
    (want, want_w), (got, got_w) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(replicas))
    assert_logs_close(got[0], want[0])
    assert_logs_close(got[1], want[1])
    assert_weights_close(got_w, want_w, atol=2e-6)


def test_a_loss_or_metric_by_name_on_a_masked_output_is_refused_with_what_to_give():
    """lockstep's own losses and metrics (given by name) count every element: on a masked output
    they would differ from Keras' silently, so they are refused, naming the Keras object to give."""
    with ls.MirroredStrategy(2).scope():
        by_name = _tagger(True, lambda: "sparse_categorical_crossentropy")()
        metric_by_name = _tagger(True, keras.losses.SparseCategoricalCrossentropy, lambda: ["accuracy"])()
    with pytest.raises(ValueError, match="carries a Keras mask .* compile with the Keras loss object instead"):
        by_name.fit(_TOKENS, _TAGS, batch_size=4, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"carries a Keras mask .* metrics \['accuracy'\] are lockstep's own"):
        metric_by_name.evaluate(_TOKENS, _TAGS, batch_size=4, verbose=0)


def test_ignore_class_outside_the_classes_trains_as_keras():
    """`ignore_class=-1` with -1 tags (the usual "void" label): lockstep's label check refused them
    as outside the classes; Keras trains on the other labels."""
    tags = np.where(_TOKENS == 0, -1, _TAGS)
    build = _tagger(False, lambda: keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))

    def run(model):
        return model.fit(_TOKENS, tags, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    (want, want_w), (got, got_w) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(3))
    assert_logs_close(got, want)
    assert_weights_close(got_w, want_w, atol=2e-6)


class _MonteCarlo(L.Layer):
    """Monte-Carlo dropout: `Dropout` and `BatchNormalization` called with ``training=True`` inside a
    layer's `call`, so they draw and update their statistics in `predict` and `evaluate` too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop, self.norm = L.Dropout(0.5), L.BatchNormalization(name="norm")

    def call(self, x, training=None):
        return self.norm(self.drop(x, training=True), training=True)


def _monte_carlo():
    inp = keras.Input((5,))
    model = keras.Model(inp, L.Dense(1, name="head")(_MonteCarlo()(L.Dense(6, activation="relu", name="hidden")(inp))))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("strategy", [lambda: ls.MirroredStrategy(1), lambda: ls.MirroredStrategy(3),
                                      lambda: ls.MirroredStrategy(8),
                                      lambda: ls.ShardedStrategy(mesh=ls.DeviceMesh((2, 4), ("batch", "model")),
                                                                 layout_map={".*norm/.*": ("model",)},
                                                                 batch_dim_name="batch", zero_stage=3)])
def test_a_model_that_draws_and_updates_its_state_in_inference_keeps_it_as_keras_does(strategy):
    """Monte-Carlo dropout: Keras' predict and evaluate keep the seed state and moving statistics a
    call changes, from batch to batch and call to call (repeated predicts are new samples).
    lockstep's inference steps dropped them: every batch drew the first batch's masks and a second
    predict repeated the first. 13 rows in batches of 4: a last batch of one row (replicas without
    rows); on the 2x4 mesh the 6 statistics split over 4 devices are stored padded."""
    x = np.random.default_rng(0).normal(size=(13, 5)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(13, 1)).astype(np.float32)

    def run(model):
        first, second = (model.predict(x, batch_size=4, verbose=0) for _ in range(2))
        evaluated = model.evaluate(x, y, batch_size=4, verbose=0)
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, validation_data=(x, y)).history
        return first, second, evaluated, history, [np.asarray(v) for v in model.non_trainable_variables]
    (want, want_w), (got, got_w) = in_keras_and_lockstep(lambda: (keras.utils.set_random_seed(0), _monte_carlo())[1],
                                                         run, strategy())
    assert not np.allclose(want[0], want[1])  # the reference draws anew
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert_logs_close(got[3], want[3])
    assert_weights_close(got[4], want[4], atol=1e-5)
    assert_weights_close(got_w, want_w, atol=1e-5)
