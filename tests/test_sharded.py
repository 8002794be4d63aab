"""Sharded models (`ls.ShardedStrategy`): a 2-D mesh, layout rules and ZeRO stages, equal to one
device (Keras' own `fit`, or lockstep on one device where Keras has no such setting), with the
memory each device holds measured from the arrays' shards, and state that moves between meshes."""

import gc
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
import numpy as np
import pytest
from keras import layers as L

import lockstep as ls
from keras_reference import assert_equals_one_device, assert_weights_close
from sharded_cases import (ALL_MODELS, COMPILE, MESHES, MODELS, Preempted, backed_up_fit, case_data, cnn, device_bytes,
                           functional_mlp, keras_fit, mlp, sharded_fit, sharded_strategy, transformer, used_rules)
from suite import variants

CASES = [(m, shape, stage) for m in MODELS for shape in MESHES for stage in (0, 1, 2, 3)
         if not (shape == (8, 1) and stage == 0)]  # (8, 1) at stage 0 splits nothing: see the error test


@pytest.mark.parametrize("model_name,shape,stage", variants(CASES, {
    ("mlp", (8, 1), 1), ("mlp", (1, 8), 2), ("cnn", (4, 2), 3), ("lstm", (2, 4), 3)}))  # the transformer: test_evaluate_predict_and_gather_on_a_sharded_model
def test_two_epochs_equal_keras_own_fit_on_one_device(model_name, shape, stage):
    x, y = case_data(model_name)
    want = keras_fit(MODELS[model_name], x, y)
    rules = used_rules(model_name)  # (what stays replicated is checked in test_bad_rules_...)
    trainer, got = sharded_fit(MODELS[model_name], sharded_strategy(shape, stage, rules, max_replicated_fraction=1.0), x, y)
    assert_equals_one_device(got, want, rtol=2e-5, atol=5e-6)
    report = trainer.layouts.report()
    assert all(key in report for key in rules)


@pytest.mark.parametrize("n,shape,stage", variants([(1, (8, 1), 3), (3, (4, 2), 3), (5, (2, 4), 2)], {(1, (8, 1), 3)}))
def test_replicas_holding_no_row_change_nothing(n, shape, stage):
    """N under the replica count: replicas with padding only (every batch), against Keras' own fit."""
    x, y = case_data("cnn", n=n)
    want = keras_fit(cnn, x, y)
    _, got = sharded_fit(cnn, sharded_strategy(shape, stage, used_rules("cnn"), max_replicated_fraction=1.0), x, y)
    assert_equals_one_device(got, want, rtol=2e-5, atol=5e-6)


def test_pure_zero_equals_data_parallel_on_the_same_devices_bit_for_bit():
    x, y = case_data("mlp")
    with ls.MirroredStrategy(8).scope():
        keras.utils.set_random_seed(1)
        model = mlp()
        model.compile(**COMPILE)
    plain = ls.Trainer(model)
    h = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for stage in (1, 3):
        _, (w, hs) = sharded_fit(mlp, sharded_strategy((8, 1), stage, rules={}), x, y)
        assert hs == h
        for a, b in zip(w, plain.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_variables_are_created_in_their_layout_inside_the_scope():
    strategy = sharded_strategy((2, 4), 3, used_rules("mlp"))
    with strategy.scope():
        model = mlp()
    kernel = model.get_layer("dense_a").kernel.value
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("batch", "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(6, 8)}  # (12, 32) over 2 x 4 devices


def _wide():
    return keras.Sequential([keras.Input((64,)), L.Dense(256, activation="relu", name="dense_1"),
                             L.Dense(256, activation="relu", name="dense_2"), L.Dense(8, name="dense_3")])


@pytest.mark.parametrize("stage", variants([0, 1, 2, 3], {1, 3}))
def test_memory_per_device_is_what_the_stage_promises_and_the_estimate_says(stage):
    x, y = case_data("mlp", n=16)
    x = np.random.RandomState(0).randn(16, 64).astype("float32")
    strategy = sharded_strategy((8, 1), stage, rules={}, min_shard_size=1024, max_replicated_fraction=1.0)
    with strategy.scope():
        model = _wide()
        model.compile(**COMPILE)
    trainer = ls.Trainer(model)
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state = trainer.train_state
    n, p = 8, model.count_params()  # fp32 Adam: 4 bytes of parameter and 8 of state per parameter
    small = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables if np.prod(v.shape) < 1024)
    params, opt = device_bytes(state.params), device_bytes(state.opt_state)
    assert len(set(params.values())) == 1 and len(set(opt.values())) == 1  # every device alike
    per_device = params[jax.devices()[0]] + opt[jax.devices()[0]]
    hyper = 64  # Adam's step counts and hyperparameters: a few replicated scalars
    bound = {0: 12 * p, 1: 4 * p + 8 * p / n, 2: 4 * p + 8 * p / n, 3: 12 * p / n}[stage]
    assert per_device <= bound * 1.02 + 3 * small + hyper
    if stage == 0:
        assert per_device >= 12 * p
    estimate = ls.memory_estimate(model, model.optimizer, strategy)  # as worked out before anything is placed
    assert estimate["parameters"] == params[jax.devices()[0]]
    assert abs(estimate["optimizer_state"] - opt[jax.devices()[0]]) <= hyper
    sharded = sum(v.nbytes for v in trainer.layouts.variables if v.split)
    assert stage == 0 or sharded >= 0.98 * 4 * p  # at least 98% of parameter bytes sharded by default
    # `fit` lends the Keras variables (the model's, Adam's) the state as it lies, sharded or not: a
    # device holds none beside the step (no variable here is stored padded)
    assert not any(v.padded for v in trainer.layouts.variables)
    step = trainer.step_memory()
    assert step["keras_variables"] == 0 and step["device_peak"] == step["peak"]


def test_state_saved_on_one_mesh_restores_onto_any_other_and_the_run_goes_on_as_if_uninterrupted():
    x, y = case_data("mlp")
    rules = used_rules("mlp")
    whole, (w_whole, h_whole) = sharded_fit(mlp, sharded_strategy((2, 4), 3, rules), x, y, epochs=2)
    first, _ = sharded_fit(mlp, sharded_strategy((2, 4), 3, rules), x, y, epochs=1)
    saved = first.train_state
    saved_host = jax.tree.map(np.asarray, (saved.params, saved.opt_state))
    for target in [sharded_strategy((4, 2), 3, rules), sharded_strategy((8, 1), 1, rules), sharded_strategy((2, 4), 0, rules),
                   ls.OneDeviceStrategy()]:
        with target.scope():
            keras.utils.set_random_seed(5)  # other initial weights: the restore must replace them all
            model = mlp()
            model.compile(**COMPILE)
        trainer = ls.Trainer(model)
        trainer.get_weights()
        trainer.restore(saved)
        now = jax.tree.map(np.asarray, (trainer.train_state.params, trainer.train_state.opt_state))
        for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(saved_host)):
            np.testing.assert_array_equal(a, b)
        history = trainer.fit(x, y, batch_size=8, epochs=2, initial_epoch=1, shuffle=False, verbose=0).history
        assert_weights_close(trainer.get_weights(), w_whole, atol=5e-6)
        np.testing.assert_allclose(history["loss"], h_whole["loss"][1:], rtol=2e-5)


def test_backup_and_restore_resumes_on_another_mesh(tmp_path):
    x, y = case_data("mlp")
    rules = used_rules("mlp")
    _, (w_whole, _) = sharded_fit(mlp, sharded_strategy((2, 4), 3, rules), x, y, epochs=2)

    with pytest.raises(Preempted):  # a run cut short after its first epoch
        backed_up_fit(sharded_strategy((2, 4), 3, rules), tmp_path / "backup", x, y, cut_short=True)
    resumed, backup = backed_up_fit(sharded_strategy((8, 1), 2, rules), tmp_path / "backup", x, y)
    assert backup.restored_from == 5  # the backup of epoch 1 (5 steps of 8 rows)
    assert_weights_close(resumed.get_weights(), w_whole, atol=5e-6)



@pytest.mark.parametrize("settings,stage", [
    (dict(gradient_accumulation_steps=2), 3),
    pytest.param(dict(gradient_accumulation_steps=3), 1, marks=pytest.mark.full_suite),
    pytest.param(dict(gradient_accumulation_steps=2, dtype_policy="mixed_float16"), 2, marks=pytest.mark.full_suite),
    pytest.param(dict(dtype_policy="mixed_float16"), 3, marks=pytest.mark.full_suite),
    (dict(dtype_policy="mixed_bfloat16"), 3)])
def test_accumulation_and_mixed_precision_on_a_functional_model_equal_one_device(settings, stage):
    x, y = case_data("mlp")
    runs = []
    for strategy in (ls.OneDeviceStrategy(), sharded_strategy((2, 4), stage, {"dense_1/w": (None, "model")})):
        trainer = ls.Trainer(functional_mlp(64, 4), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                             metrics=["accuracy"], strategy=strategy, **settings)
        history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        runs.append((trainer.get_weights(), history))
    tol = 5e-6 if "dtype_policy" not in settings else 1e-2
    assert_equals_one_device(runs[1], runs[0], rtol=max(tol, 2e-5), atol=tol)
    if stage >= 2 and "gradient_accumulation_steps" in settings:  # each replica accumulates its share only
        # one replica's accumulators, as its trace made them (the training program's own: no public name)
        whole = sum(np.asarray(w).nbytes for w in jax.tree.leaves(runs[1][0]))  # P: the trainable bytes
        accumulators = [p.replica.accumulators for p in trainer._runner._programs.values()
                        if hasattr(p.replica, "accumulators")]  # (an epoch's last update of one batch has none)
        assert accumulators
        for shapes in accumulators:
            on_replica = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
            assert on_replica < 0.6 * whole  # split over the 2 replicas (variables under min_shard_size stay whole)


def test_evaluate_predict_and_gather_on_a_sharded_model():
    x, y = case_data("transformer")
    strategy = sharded_strategy((2, 4), 3, used_rules("transformer"))
    trainer, _ = sharded_fit(transformer, strategy, x, y, epochs=1)
    keras.utils.set_random_seed(1)
    reference = transformer()
    reference.compile(**COMPILE)
    reference.set_weights(trainer.get_weights())
    np.testing.assert_allclose(trainer.predict(x, batch_size=8), reference.predict(x, batch_size=8, verbose=0),
                               rtol=1e-5, atol=1e-6)
    got = trainer.evaluate(x, y, batch_size=8)
    want = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    np.testing.assert_allclose([got["loss"], got["accuracy"]], [want["loss"], want["accuracy"]], rtol=1e-5)
    kernel = trainer.train_state.params["trainable"][0]
    assert not kernel.is_fully_replicated
    whole = trainer.get_weights()[0]  # a variable is one value on every replica (mirrored), never a shard:
    np.testing.assert_array_equal(np.asarray(strategy.gather(kernel, axis=0)), np.concatenate([whole] * 2))
    np.testing.assert_allclose(np.asarray(strategy.reduce("MEAN", kernel)), whole, rtol=1e-6)
    total = strategy.reduce("SUM", strategy.run(lambda: ls.get_replica_context().replica_id_in_sync_group * 1.0))
    assert float(total) == 1.0  # replicas 0 and 1 of the batch axis


def test_keras_layout_objects_are_accepted():
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=keras.distribution.list_devices())
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*dense.*/kernel"] = (None, "model")
    x, y = case_data("mlp")
    strategy = ls.ShardedStrategy(mesh=mesh, layout_map=layout, batch_dim_name="batch", zero_stage=3,
                                  min_shard_size=128, max_replicated_fraction=0.3)
    want = keras_fit(mlp, x, y)
    _, got = sharded_fit(mlp, strategy, x, y)
    assert_equals_one_device(got, want, atol=5e-6)


@pytest.mark.parametrize("build,message", [
    (lambda: sharded_strategy((2, 4), 1, {".*kernel": (None, "tensor")}), "lacks"),
    (lambda: ls.ShardedStrategy(mesh=ls.DeviceMesh((4, 4), ("batch", "model"))), "needs 16 devices"),
    (lambda: sharded_strategy((2, 4), 1, {".*kernel": ("model", "model")}), "same mesh axis"),
    (lambda: sharded_strategy((2, 4), 1, {".*kernel": (None, "batch")}), "batch axis"),
    (lambda: sharded_strategy((2, 4), 4), "zero_stage"),
    (lambda: ls.ShardedStrategy(mesh=ls.DeviceMesh((2, 4), ("data", "model")), batch_dim_name="batch"),
     "batch_dim_name"),
])
def test_bad_layouts_are_named_before_any_step(build, message):
    with pytest.raises(ls.UsageError, match=message):
        build()


@pytest.mark.parametrize("rules,kw,message", [
    ({".*dense.*/kernel": (None, "model"), ".*conv.*/kernel": (None, "model")}, {}, "match no variable"),
    ({}, {"max_replicated_fraction": 0.02}, "would stay replicated"),
    ({".*dense.*/kernel": (None, "model", None)}, {}, "one mesh axis name or None per dimension"),
])
def test_bad_rules_for_the_model_are_named_before_any_step(rules, kw, message):
    strategy = sharded_strategy((2, 4), 0, rules, **kw)
    x, y = case_data("mlp")
    with pytest.raises(ls.UsageError, match=message) as err:
        with strategy.scope():  # the variables are made in their layouts: a rule that cannot be is named here
            model = mlp()
        model.compile(**COMPILE)
        ls.Trainer(model).fit(x, y, batch_size=8, verbose=0)
    if message == "would stay replicated":
        assert "dense_a/kernel" in str(err.value)  # the report comes with it


def test_keras_model_parallel_is_refused_with_the_lockstep_name_for_it():
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices=keras.distribution.list_devices())
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*dense.*/kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch"))
    try:
        model = mlp()
        model.compile(**COMPILE)
        with pytest.raises(ValueError, match="ShardedStrategy"):
            ls.Trainer(model)
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("model_name,shape,stage,k,accumulation,n", variants(
    [("transformer", (2, 4), 3, 1, 1, 37), ("odd_cnn", (4, 2), 2, 3, 2, 61), ("mlp", (8, 1), 1, 1, 1, 3),
     ("lstm", None, None, 2, 1, 13)], {("transformer", (2, 4), 3, 1, 1, 37), ("mlp", (8, 1), 1, 1, 1, 3)}))
def test_step_memory_of_data_is_known_before_any_step_and_is_the_step_fit_runs(model_name, shape, stage, k,
                                                                             accumulation, n):
    """`step_memory(x, y, batch_size)` before any step compiles the program `fit` runs first and runs
    nothing (the weights stay the initial ones); the figures are those another trainer of the same
    model reports after its `fit`, and another batch size gives its own: sharded (ZeRO-3 over a 2x4
    mesh, tensor-parallel rules) or replicated, with several steps a call, gradient accumulation,
    and (n = 3 on 8 replicas) replicas holding no row."""
    x, y = case_data(model_name, n=n)
    strategy = (ls.MirroredStrategy(8) if shape is None else
                sharded_strategy(shape, stage, used_rules(model_name), min_shard_size=16, max_replicated_fraction=1.0))
    trainers = []
    for _ in range(2):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = ALL_MODELS[model_name]()
            model.compile(**COMPILE, steps_per_execution=k)
        trainers.append(ls.Trainer(model, gradient_accumulation_steps=accumulation))
    trainer, fitted = trainers
    assert trainer.step_memory() is None
    initial = [w.copy() for w in trainer.model.get_weights()]
    larger = trainer.step_memory(x, y, batch_size=16)
    ahead = trainer.step_memory(x, y, batch_size=8)
    assert trainer.global_step == 0
    for got, want in zip(trainer.get_weights(), initial):
        np.testing.assert_array_equal(got, want)
    assert ahead["peak"] > ahead["arguments"] > 0
    if n > 8:  # more than one batch of 8: batches of 16 make another program, with figures of its own
        assert larger != ahead
    fitted.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = fitted.step_memory()
    assert {k: after[k] for k in ("arguments", "outputs", "temporaries", "peak")} == \
           {k: ahead[k] for k in ("arguments", "outputs", "temporaries", "peak")}
    # (``keras_variables``: what the Keras objects hold when asked; fit's end gives the Keras optimizer its state)
    assert ahead["device_peak"] == ahead["peak"] + ahead["keras_variables"]


@pytest.mark.parametrize("strategy", [lambda: ls.MirroredStrategy(8), lambda: sharded_strategy(
    (2, 4), 3, {}, min_shard_size=1, max_replicated_fraction=1.0)], ids=["replicated", "zero3"])
def test_step_memory_before_any_step_places_no_state(strategy):
    """Before the state exists, `step_memory(x, y, batch_size)` compiles the step from the state's
    shapes where they would lie: no parameter copy or optimizer state is placed (the arrays shaped
    like the (384, 384) kernel on the devices stay the Keras kernel and its two Adam slots; the
    state's first use, reading the learning rate, places it: its copy and its two moments), and
    XLA's figures are those of the step once the state is placed, and `step_memory()` asked then
    gives those of that step. `keras_variables` counts the Keras variables of arrays a sharded state
    stores padded (the (3,) bias and its slots, split in 8), no others (`fit` lends them the state)."""
    def kernels():  # global arrays (on all 8 devices) shaped like the middle kernel
        gc.collect()
        return sum(a.shape == (384, 384) and len(a.sharding.device_set) == 8 for a in jax.live_arrays())
    earlier = kernels()  # other tests' models still alive
    with strategy().scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(384, activation="relu"),
                                  keras.layers.Dense(384, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = ls.Trainer(model)
    x, y = np.ones((13, 4), np.float32), np.arange(13) % 3
    before = kernels()
    assert before == earlier + 3  # the Keras variable and Keras Adam's two slots
    ahead = trainer.step_memory(x, y, batch_size=8)
    assert kernels() == before and trainer.step_memory() == ahead
    assert trainer.learning_rate == pytest.approx(0.001)  # the state's first use places it
    assert kernels() == before + 3
    after = trainer.step_memory(x, y, batch_size=8)
    xla = ("arguments", "outputs", "temporaries", "peak")
    assert {k: after[k] for k in xla} == {k: ahead[k] for k in xla}
    padded = [v for v in trainer.layouts.variables if v.padded] if trainer.layouts else []
    assert [v.shape for v in padded] == ([(3,)] if trainer.layouts else [])
    bias = [v for v in [*model.weights, *model.optimizer.variables] if v.shape == (3,)]  # and its two slots
    assert len(bias) == 3
    held = sum(s.data.nbytes for v in bias for s in v.value.addressable_shards if s.device == jax.devices()[0])
    assert ahead["keras_variables"] == after["keras_variables"] == (held if padded else 0)


@pytest.mark.parametrize("stage", [None, 1, 3])
def test_the_keras_variables_are_counted_beside_the_step_where_fit_does_not_lend_them_the_state(stage):
    """`fit` leaves the Keras variables a copy of the trained state (`sync_model`). The next `fit`
    lends them its state as it begins (`lend_state`), replicated or sharded (ZeRO-1: replicated
    weights, sharded moments; ZeRO-3: all sharded), a Keras optimizer's moments too: at its batch
    ends a device holds the kernel's buffer three times (the weights, Adam's two moments), not
    four or six, and `keras_variables` counts none of them. A variable of a sharded state's arrays
    stored padded (the (3,) bias or its moments, split in 2 or 8) is lent them in hooks only:
    counted beside the step, its own buffer."""
    strategy = ls.MirroredStrategy(4) if stage is None else sharded_strategy((2, 4), stage, {}, min_shard_size=1)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = ls.Trainer(model)
    x, y = np.ones((13, 4), np.float32), np.arange(13) % 3
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    kernels = []

    class Held(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            gc.collect()
            kernels.append(len({s.data.unsafe_buffer_pointer() for a in jax.live_arrays()
                                if a.shape == (4, 64) and not a.is_deleted()
                                for s in a.addressable_shards if s.device == jax.devices()[0]}))
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Held()])
    counted = trainer.step_memory()["keras_variables"]
    assert kernels == [3, 3]
    layouts = [] if stage is None else trainer.layouts.variables
    weights = [v.path for v in layouts if v.stored_shape(v.param_spec) != v.shape]  # stored padded
    moments = [v.path for v in layouts if v.stored_shape(v.state_spec) != v.shape]
    own = [v.value for v in model.weights if v.path in weights]
    own += [v.value for v in model.optimizer.variables if any(v.path.endswith(p.replace("/", "_") + "_" + s)
                                                              for p in moments for s in ("momentum", "velocity"))]
    assert counted == sum(s.data.nbytes for a in own for s in a.addressable_shards if s.device == jax.devices()[0])
    assert (counted > 0) == (stage is not None), (stage, weights, moments, counted)


def test_step_memory_of_an_iterator_is_refused_before_it_reads_a_batch():
    """An iterator's batches that `step_memory` read would be missing from the `fit` that follows."""
    x, y = case_data("mlp", n=16)
    trainer = ls.Trainer(mlp(), optimizer="adam", loss="mse", strategy=ls.MirroredStrategy(2))
    batches = iter([(x[:8], y[:8]), (x[8:], y[8:])])
    with pytest.raises(ValueError, match="step_memory.*iterator"):
        trainer.step_memory(batches)
    assert len(list(batches)) == 2


@pytest.mark.parametrize("model_name,shape,stage,accumulation", variants(
    [("odd_cnn", (2, 4), 3, 1), ("odd", (8, 1), 2, 2), ("odd", (2, 4), 1, 3), ("transformer", (4, 2), 1, 1),
     ("odd_cnn", (4, 2), 3, 2)], {("odd_cnn", (2, 4), 3, 1), ("odd", (2, 4), 1, 3)}))
def test_steps_per_execution_takes_k_updates_a_call_equal_to_one_a_call(model_name, shape, stage, accumulation):
    """Equal up to float32 rounding (XLA partitions a step inside a loop its own way: a convolution's
    weights moved by 3e-8), not bit for bit."""
    x, y = case_data(model_name, n=61)  # 8 batches of 8 a epoch, the last of 5 rows
    runs = []
    for k in (1, 3):
        strategy = sharded_strategy(shape, stage, used_rules(model_name), min_shard_size=16, max_replicated_fraction=1.0)
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = ALL_MODELS[model_name]()
            model.compile(**COMPILE, steps_per_execution=k)  # Keras' own setting
        trainer = ls.Trainer(model, gradient_accumulation_steps=accumulation)
        history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=True, seed=3, verbose=0).history
        runs.append((trainer.get_weights(), history))
    assert any(key[0] in ("resident", "stacked") and key[-2] > 1 for key in trainer._runner._programs)  # (no public name)
    assert_equals_one_device(runs[1], runs[0], rtol=1e-6, atol=1e-6)
