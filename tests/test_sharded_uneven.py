"""Uneven splits on sharded models (`ls.ShardedStrategy`): a variable that a layout rule or ZeRO
splits along an axis that does not divide it is stored padded with zeros, never refused, and every
number equals one device (Keras' own `fit`, or lockstep on one device); the stored shards are what
the estimate says, and state saved under one padding restores under another bit for bit."""

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
import numpy as np
import pytest
from keras import layers as L

import lockstep as ls
from keras_reference import assert_equals_one_device, assert_weights_close
from sharded_cases import (COMPILE, ODD_MODELS, Preempted, StopAfterFirstEpoch, case_data, device_bytes, functional_mlp,
                           keras_fit, odd, sharded_fit, sharded_strategy, used_rules)
from suite import FULL, variants

CASES = [("odd", (8, 1), 3), ("odd", (2, 4), 3), ("odd", (4, 2), 2), ("odd", (1, 8), 1), ("odd", (4, 2), 0),
         ("odd_cnn", (2, 4), 3), ("odd_cnn", (4, 2), 1), ("odd_cnn", (1, 8), 2)]


def _stored(trainer):
    """The trainer's state as it lies on the devices (padded; `train_state` gives it unpadded)."""
    return trainer._state  # no public name: what leaves the trainer is never padded


def _assert_padding_holds_zeros(trainer):
    """Every stored array's padding (parameters and optimizer state) is zero."""
    state, layout = _stored(trainer), trainer._layout
    layouts = jax.tree.leaves((layout._layouts, layout._layouts_of_state(state.opt_state)))
    checked = 0
    for leaf, v in zip(jax.tree.leaves((state.params, state.opt_state)), layouts):
        if not hasattr(v, "shape") or tuple(leaf.shape) == v.shape or len(leaf.shape) != len(v.shape):
            continue
        whole = np.asarray(leaf)
        for dim, size in enumerate(v.shape):
            assert not whole[(slice(None),) * dim + (slice(size, None),)].any()
        checked += 1
    assert checked  # some array is padded


@pytest.mark.parametrize("model_name,shape,stage", variants(CASES, {("odd", (2, 4), 3), ("odd_cnn", (2, 4), 3)}))
def test_uneven_splits_are_stored_padded_and_equal_keras_own_fit(model_name, shape, stage):
    x, y = case_data(model_name)
    want = keras_fit(ODD_MODELS[model_name], x, y)
    rules = used_rules(model_name) if shape[1] > 1 else {}
    strategy = sharded_strategy(shape, stage, rules, min_shard_size=16, max_replicated_fraction=1.0)
    trainer, got = sharded_fit(ODD_MODELS[model_name], strategy, x, y)
    assert_equals_one_device(got, want, rtol=2e-5, atol=5e-6)
    padded = [v for v in trainer.layouts.variables if v.padded]
    assert padded and "stored padded to" in trainer.layouts.report()
    stored = _stored(trainer).params
    for v, leaf in zip(trainer.layouts.variables, jax.tree.leaves(stored)):
        assert leaf.shape == v.stored_shape(v.param_spec)  # padded at rest, where the splits do not divide
        assert leaf.sharding.spec == v.param_spec
    for leaf, v in zip(jax.tree.leaves(trainer.train_state.params), trainer.layouts.variables):
        assert leaf.shape == v.shape  # and what leaves the trainer has the variable's own shape
    _assert_padding_holds_zeros(trainer)  # the steps never write into the padding
    model = trainer.model
    assert_weights_close(model.get_weights(), want[0], atol=5e-6)  # the Keras model holds its own shapes


def test_zero_prefers_a_dimension_it_divides_and_pads_only_when_none_is():
    strategy = sharded_strategy((4, 1), 3, {}, min_shard_size=16)
    with strategy.scope():
        model = odd()
    x, y = case_data("odd")
    model.compile(**COMPILE)
    trainer = ls.Trainer(model)
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    layouts = {v.path.split("/", 1)[1]: v for v in trainer.layouts.variables}
    a, b = layouts["dense_a/kernel"], layouts["dense_b/kernel"]
    assert a.zero_dim == 0 and not a.padded  # (12, 30): 4 divides 12, not the larger 30
    assert b.zero_dim == 0 and b.stored_shape(b.param_spec) == (32, 7)  # (30, 7): 4 divides neither


def _wide_odd():
    return keras.Sequential([keras.Input((64,)), L.Dense(250, activation="relu", name="dense_1"),
                             L.Dense(250, activation="relu", name="dense_2"), L.Dense(10, name="dense_3")])


@pytest.mark.parametrize("stage", variants([1, 2, 3], {3}))
def test_padded_shards_are_the_memory_each_device_holds_and_the_estimate_says(stage):
    x = np.random.RandomState(0).randn(16, 64).astype("float32")
    y = np.arange(16) % 10
    strategy = sharded_strategy((8, 1), stage, rules={}, min_shard_size=1024, max_replicated_fraction=0.02)
    with strategy.scope():
        model = _wide_odd()
        model.compile(**COMPILE)
    trainer = ls.Trainer(model)
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state = _stored(trainer)
    n, p = 8, model.count_params()
    small = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables if np.prod(v.shape) < 1024)
    params, opt = device_bytes(state.params), device_bytes(state.opt_state)
    for v, leaf in zip(trainer.layouts.variables, jax.tree.leaves(state.params)):  # each device: ceil(size / 8)
        ways = [8 if axis == "batch" else 1 for axis in tuple(v.param_spec) + (None,) * len(v.shape)]
        assert {s.data.shape for s in leaf.addressable_shards} == {tuple(-(-d // n) for d, n in zip(v.shape, ways))}
    assert any(v.padded for v in trainer.layouts.variables)  # 250 over 8 devices
    per_device = params[jax.devices()[0]] + opt[jax.devices()[0]]
    hyper = 64
    padding = 256 / 250  # 250 rows or columns padded to 256
    bound = {1: 4 * p + 8 * p / n * padding, 2: 4 * p + 8 * p / n * padding, 3: 12 * p / n * padding}[stage]
    assert per_device <= bound * 1.02 + 3 * small + hyper
    estimate = ls.memory_estimate(model, model.optimizer, strategy)
    assert estimate["parameters"] == params[jax.devices()[0]]
    assert abs(estimate["optimizer_state"] - opt[jax.devices()[0]]) <= hyper
    assert sum(v.nbytes for v in trainer.layouts.variables if v.split) >= 0.98 * 4 * p


def _fit(strategy, epochs, callbacks=(), initial=None):
    x, y = case_data("odd")
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = odd()
        model.compile(**COMPILE)
    trainer = ls.Trainer(model)
    if initial is not None:
        trainer.get_weights()
        trainer.restore(initial)
    history = trainer.fit(x, y, batch_size=8, epochs=epochs, initial_epoch=0 if initial is None else initial.epoch,
                          shuffle=False, verbose=0, callbacks=list(callbacks)).history
    return trainer, history


ODD_RULES = {".*dense.*/kernel": (None, "model")}


def test_state_saved_under_one_padding_restores_under_another_bit_for_bit_and_goes_on(tmp_path):
    whole, h_whole = _fit(ls.OneDeviceStrategy(), 2)
    first, _ = _fit(sharded_strategy((8, 1), 3, {}, min_shard_size=16), 1)  # (30, 7) stored as (32, 7), ...
    saved = first.train_state
    saved_host = [np.asarray(a) for a in jax.tree.leaves((saved.params, saved.opt_state))]
    targets = [sharded_strategy((2, 4), 3, ODD_RULES, min_shard_size=16),  # (30, 7) stored as (30, 8)
               sharded_strategy((4, 2), 1, ODD_RULES, min_shard_size=16), ls.OneDeviceStrategy()]
    for target in targets if FULL else targets[::2]:
        with target.scope():
            keras.utils.set_random_seed(5)  # other initial weights: the restore replaces them all
            model = odd()
            model.compile(**COMPILE)
        trainer = ls.Trainer(model)
        trainer.get_weights()
        trainer.restore(saved)
        now = [np.asarray(a) for a in jax.tree.leaves((trainer.train_state.params, trainer.train_state.opt_state))]
        for a, b in zip(now, saved_host):
            np.testing.assert_array_equal(a, b)
        if trainer.layouts is not None:
            _assert_padding_holds_zeros(trainer)  # padded again, with zeros, as this mesh pads it
        x, y = case_data("odd")
        history = trainer.fit(x, y, batch_size=8, epochs=2, initial_epoch=1, shuffle=False, verbose=0).history
        assert_weights_close(trainer.get_weights(), whole.get_weights(), atol=5e-6)
        np.testing.assert_allclose(history["loss"], h_whole["loss"][1:], rtol=2e-5)
    # a backup taken on (2, 4) at stage 3, cut short, resumed on (8, 1) at stage 2 (other paddings)
    with pytest.raises(Preempted):
        _fit(sharded_strategy((2, 4), 3, ODD_RULES, min_shard_size=16), 2,
             [ls.callbacks.BackupAndRestore(str(tmp_path / "backup")), StopAfterFirstEpoch()])
    backup = ls.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    resumed, _ = _fit(sharded_strategy((8, 1), 2, {}, min_shard_size=16), 2, [backup])
    assert backup.restored_from == 5
    assert_weights_close(resumed.get_weights(), whole.get_weights(), atol=5e-6)



@pytest.mark.parametrize("settings,stage", [
    (dict(gradient_accumulation_steps=2), 3), (dict(gradient_accumulation_steps=3), 1),
    pytest.param(dict(gradient_accumulation_steps=2, dtype_policy="mixed_float16"), 2, marks=pytest.mark.full_suite),
    pytest.param(dict(dtype_policy="mixed_bfloat16"), 3, marks=pytest.mark.full_suite)])
def test_uneven_accumulation_and_mixed_precision_on_a_functional_model_equal_one_device(settings, stage):
    x, y = case_data("mlp")
    runs = []
    rules = {"dense_1/w": (None, "model"), "dense_2/w": ("model", None)}  # 30 over 4 model devices
    for strategy in (ls.OneDeviceStrategy(), sharded_strategy((2, 4), stage, rules, min_shard_size=16)):
        trainer = ls.Trainer(functional_mlp(30, 5), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                             metrics=["accuracy"], strategy=strategy, **settings)
        history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        runs.append((trainer.get_weights(), history))
    assert any(v.padded for v in trainer.layouts.variables)
    tol = 5e-6 if "dtype_policy" not in settings else 1e-2
    assert_equals_one_device(runs[1], runs[0], rtol=max(tol, 2e-5), atol=tol)


@pytest.mark.parametrize("stage", [3, 1])
def test_keras_code_as_written_with_uneven_splits(tmp_path, stage):
    """`compile` / `fit` / `evaluate` / `predict` / `save` in the scope, a Keras optimizer object,
    Keras callbacks that set the learning rate and the weights (`restore_best_weights`)."""
    x, y = case_data("odd")

    def fit(strategy=None):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(1)
            model = odd()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss=COMPILE["loss"], metrics=["accuracy"])
            callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
                         keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,  # stops after epoch 1
                                                       restore_best_weights=True)]  # and puts epoch 0's weights back
            history = model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks).history
            return model, history, model.evaluate(x, y, batch_size=8, verbose=0), model.predict(x, batch_size=8,
                                                                                                 verbose=0)
    want = fit()
    got = fit(sharded_strategy((2, 4), stage, ODD_RULES, min_shard_size=16))
    assert len(got[1]["loss"]) == 2
    assert_equals_one_device((got[0].get_weights(), got[1]), (want[0].get_weights(), want[1]), rtol=2e-5, atol=5e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got[3], want[3], rtol=2e-5, atol=5e-6)
    for a, b in zip(got[0].optimizer.variables, want[0].optimizer.variables):  # Adam's moments, in their shapes
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-4, atol=1e-7)
    got[0].save(tmp_path / "odd.keras")
    for a, b in zip(keras.models.load_model(tmp_path / "odd.keras").get_weights(), got[0].get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_state_of_other_shapes_is_refused_on_restore():
    trainer, _ = _fit(sharded_strategy((8, 1), 3, {}, min_shard_size=16), 1)
    state = trainer.train_state
    params = {"trainable": list(state.params["trainable"]), "non_trainable": state.params["non_trainable"]}
    params["trainable"][2] = np.zeros((32, 7), np.float32)  # (30, 7) as stored, padded: not a variable's shape
    with pytest.raises(ValueError, match=r"shape \(32, 7\).*\(30, 7\)"):
        trainer.restore(state.replace(params=params))


def test_a_background_model_checkpoint_of_a_padded_zero3_state_writes_what_a_synchronous_one_does(tmp_path):
    """`ModelCheckpoint` in the background takes copies on the devices of a state stored padded
    (cut to the variables' shapes) and of the arrays the next step takes over; every 3 steps, so
    saves fall mid-epoch: its files, weights and optimizer state, equal a synchronous one's."""
    strategy = sharded_strategy((2, 4), 3, used_rules("odd"), min_shard_size=16, max_replicated_fraction=1.0)
    x, y = case_data("odd")
    for kind, background in (("bg", True), ("now", False)):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = odd()
            model.compile(**COMPILE)
        trainer = ls.Trainer(model)
        trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
            ls.callbacks.ModelCheckpoint(str(tmp_path / f"{kind}-{{epoch}}.npz"), save_freq=3, async_save=background)])
    assert [v for v in trainer.layouts.variables if v.padded]
    like = {"weights": trainer.get_weights(), "opt_state": jax.tree.map(np.asarray, trainer.current_state().opt_state)}
    for epoch in (1, 2):
        got, extra = ls.checkpoint.load_tree(tmp_path / f"bg-{epoch}.npz", like)
        want, want_extra = ls.checkpoint.load_tree(tmp_path / f"now-{epoch}.npz", like)
        assert extra == want_extra
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
