"""TensorFlow users' code as they write it (issue 40): Keras' defaults on several workers, worker 0's
initial weights, TF's distributed datasets, TF spellings. Every number is held to Keras' own
one-device `model.fit` (or NumPy); every TF idiom lockstep cannot honour is a clear error."""

import gc
import os
import subprocess
import sys
import warnings
import weakref

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import lockstep as ls
from keras_reference import assert_logs_close, assert_weights_close
from launching import CHILD_XLA_FLAGS, WORKERS, launch_workers, output_of, rank_results
from suite import variants

tf = pytest.importorskip("tensorflow")

N, B = 193, 16  # 13 batches, the last of one row: on 2 workers (or 4 replicas) the others hold none
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, 8)).astype("float32")
Y = ((X[:, 0] > 0).astype("int32") + (X[:, 1] > 0.5).astype("int32"))


def classifier(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def keras_own_fit(init, epochs=2, **fit):
    """Keras' own one-device `fit` (no lockstep scope) from the weights `init`: (weights, history)."""
    model = classifier()
    model.set_weights([np.asarray(w) for w in init])
    history = model.fit(X, Y, batch_size=B, epochs=epochs, shuffle=False, verbose=0, **fit)
    return model.get_weights(), history.history


# --- Keras' backend -------------------------------------------------------------------------------
def _python(code, **env):
    """`code` run in a fresh interpreter (Keras picks its backend once a process)."""
    clean = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, "XLA_FLAGS": CHILD_XLA_FLAGS, **env})


def test_importing_lockstep_first_selects_keras_jax_backend_and_another_backend_is_named():
    # and fitting a compiled Keras model (no metrics) in a scope does not import TensorFlow (3 s), which is installed
    ran = _python("import sys, numpy as np, lockstep as ls, keras\nwith ls.MirroredStrategy().scope():\n"
                  "    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n    m.compile('sgd', 'mse')\n"
                  "m.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)\nm.evaluate(np.ones((4, 3)), np.ones((4, 1)), verbose=0)\n"
                  "print('tensorflow' in sys.modules, keras.backend.backend())")
    assert ran.returncode == 0 and ran.stdout.strip().endswith("False jax"), ran.stdout + ran.stderr[-2000:]
    ran = _python("import keras, lockstep as ls\ntry:\n    ls.MirroredStrategy()\nexcept ls.UsageError as e:\n"
                  "    print('REFUSED', e)", KERAS_BACKEND="tensorflow")
    assert "REFUSED Keras runs on the 'tensorflow' backend" in ran.stdout, ran.stdout + ran.stderr[-2000:]
    assert "KERAS_BACKEND=jax" in ran.stdout


# --- two workers at Keras' defaults ---------------------------------------------------------------
@pytest.mark.xdist_group("processes")
def test_two_workers_at_keras_defaults_start_from_worker_0_and_equal_keras_own_fit(tmp_path):
    proc = launch_workers(WORKERS / "tf_user_job.py", N, tmp_path, nproc=2, devices=1, timeout=240)
    assert proc.returncode == 0, output_of(proc)
    results = rank_results(proc, 2)
    assert [r["backend"] for r in results] == ["jax", "jax"]
    # unseeded: each worker drew its own values, and both took worker 0's, as in TF
    for a, b in zip(results[0]["init"], results[1]["init"]):
        np.testing.assert_array_equal(a, b)
    want_w, want_h = keras_own_fit(results[0]["init"])
    for res in results:
        assert res["model_history"] == res["history"]  # `model.history`, as Keras sets it
        assert_logs_close(res["history"], want_h, rtol=2e-5)
        assert_weights_close(res["weights"], want_w, atol=5e-6)
        for name in ("distributed", "from_function"):  # TF's global and per-replica batches: the same steps
            assert_logs_close(res[name]["history"], want_h, rtol=2e-5)
            assert_weights_close(res[name]["weights"], want_w, atol=5e-6)
            # Keras' ModelCheckpoint on every worker: worker 0 wrote the last epoch's model
            assert_weights_close(keras.saving.load_model(tmp_path / f"{name}.keras").get_weights(), want_w, atol=5e-6)
        # a Keras metric updated inside `run` on both workers: each real row once (Keras' own on the whole data)
        want = keras.metrics.SparseCategoricalAccuracy()
        want.update_state(Y, np.asarray(res["predictions"]))
        assert res["accuracy_in_run"] == pytest.approx(float(want.result()), abs=1e-7)
    # shuffled as Keras' fit shuffles, on worker 0's NumPy state (seed 0) where worker 1's was seeded 1
    reference = classifier(seed=0)
    shuffled = reference.fit(X, Y, batch_size=B, epochs=2, verbose=0).history
    for res in results:
        assert_logs_close(res["shuffled"]["history"], shuffled, rtol=2e-5)
        assert_weights_close(res["shuffled"]["weights"], reference.get_weights(), atol=5e-6)
    worker_0 = next(res["shuffled"] for res in results if res["shuffled"]["rank"] == 0)  # (lines come in any order)
    assert worker_0["after"] == float(np.random.uniform())  # its NumPy state moved on as in Keras
    reference = classifier(seed=0)  # each epoch's last batch, 1 row of the 3 by the order drawn: worker 1's replica holds none
    few_rows = reference.fit(X[:3], Y[:3], batch_size=2, epochs=3, verbose=0).history
    for res in results:
        assert_logs_close(res["few_rows"]["history"], few_rows, rtol=2e-5)
        assert_weights_close(res["few_rows"]["weights"], reference.get_weights(), atol=5e-6)
    # dropout on two workers seeded apart: worker 0's weights and seed state, and the masks Keras' own fit
    # draws on one device from them
    assert results[0]["dropout_init"] == results[1]["dropout_init"]
    dropped = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dropout(0.5), keras.layers.Dense(3, activation="softmax")])
    dropped.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    dropped.set_weights([np.asarray(w) for w in results[0]["dropout_init"]["weights"]])
    seeds = [v for v in dropped.non_trainable_variables if "seed_generator" in v.path]
    assert len(seeds) == len(results[0]["dropout_init"]["seed_state"]) == 1
    for v, state in zip(seeds, results[0]["dropout_init"]["seed_state"]):
        v.assign(np.asarray(state, v.dtype))
    dropped.fit(X, Y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    for res in results:
        assert_weights_close(res["dropout"], dropped.get_weights(), atol=5e-6)
    # the progress bar (verbose=1) is worker 0's alone, and it ran to the end of both epochs
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    assert any(line.startswith("[rank 0]") and "Epoch 2/2" in line for line in lines), output_of(proc)
    assert not any(line.startswith("[rank 1]") and "Epoch 1/2" in line for line in lines), output_of(proc)


# --- TF's distributed datasets, in one process ----------------------------------------------------
def test_fit_on_tf_distributed_datasets_equals_keras_own_fit():
    strategy = ls.MirroredStrategy(4)
    init = classifier().get_weights()
    want_w, want_h = keras_own_fit(init)
    global_batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(B))
    assert len(global_batches) == 13
    per_replica = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.from_tensor_slices((X, Y)).batch(ctx.get_per_replica_batch_size(B)))
    for data in (global_batches, per_replica):
        with strategy.scope():
            model = classifier()
        model.set_weights(init)
        history = model.fit(data, epochs=2, verbose=0)
        assert_logs_close(history.history, want_h, rtol=2e-5)
        assert_weights_close(model.get_weights(), want_w, atol=5e-6)
        assert model.evaluate(data, verbose=0, return_dict=True).keys() == {"loss", "accuracy"}
        assert model.predict(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices(X).batch(B)), verbose=0).shape == (N, 3)


def test_per_replica_batches_and_local_results_are_tf_s():
    strategy = ls.MirroredStrategy(2)
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.range(5).batch(ctx.get_per_replica_batch_size(4)))
    # TF: each replica one per-replica batch of the dataset; a last step of one batch leaves a replica empty
    got = [[r.tolist() for r in strategy.experimental_local_results(b)] for b in ds]
    assert got == [[[0, 1], [2, 3]], [[4], []]]
    one = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(8))))
    assert [r.shape for r in strategy.experimental_local_results(strategy.run(lambda b: b * 2, args=(one,)))] == [
        (4,), (4,)]
    short = next(iter(strategy.experimental_distribute_dataset([np.arange(3)])))
    out = strategy.run(lambda b: {"rows": b + 1, "total": ls.get_replica_context().all_reduce("SUM", b.sum())},
                       args=(short,))
    assert [(r["rows"].tolist(), int(r["total"])) for r in strategy.experimental_local_results(out)] == [
        ([1, 2], 3), ([3], 3)]
    it = iter(ds)
    seen = []
    while (optional := it.get_next_as_optional()).has_value():
        seen.append(optional.get_value().num_real)
    assert seen == [4, 1]


# --- numbers Keras reports --------------------------------------------------------------------------
def test_class_weight_weighs_training_only_and_val_loss_is_keras_s():
    init = classifier().get_weights()
    keras_model = classifier()
    keras_model.set_weights(init)
    want = keras_model.fit(X, Y, batch_size=B, epochs=2, shuffle=False, verbose=0, validation_split=0.5,
                           class_weight={0: 1.0, 1: 5.0, 2: 2.0}).history
    strategy = ls.MirroredStrategy(4)
    with strategy.scope():
        model = classifier()
    model.set_weights(init)
    got = model.fit(X, Y, batch_size=B, epochs=2, shuffle=False, verbose=0, validation_split=0.5,
                    class_weight={0: 1.0, 1: 5.0, 2: 2.0}).history
    assert_logs_close(got, want, rtol=2e-5)
    assert_weights_close(model.get_weights(), keras_model.get_weights(), atol=5e-6)
    # the explicit form takes it too
    t = ls.Trainer(classifier(), strategy=strategy)
    t.set_weights(init)
    assert_logs_close(t.fit(X, Y, batch_size=B, epochs=2, shuffle=False, verbose=0, validation_split=0.5,
                            class_weight={0: 1.0, 1: 5.0, 2: 2.0}).history, want, rtol=2e-5)


def test_a_metric_function_is_keras_s_or_a_clear_error():
    def per_sample_abs(y_true, y_pred):
        return jnp.abs(jnp.asarray(y_true, jnp.float32) - jnp.argmax(y_pred, -1))

    def batch_rmse(y_true, y_pred):
        return jnp.sqrt(jnp.mean((jnp.asarray(y_true, jnp.float32) - jnp.argmax(y_pred, -1)) ** 2))

    init = classifier().get_weights()
    keras_model = classifier()
    keras_model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=[per_sample_abs])
    keras_model.set_weights(init)
    want = keras_model.fit(X, Y, batch_size=B, epochs=1, shuffle=False, verbose=0).history
    strategy = ls.MirroredStrategy(4)
    with strategy.scope():
        model = classifier()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=[per_sample_abs])
    model.set_weights(init)
    assert_logs_close(model.fit(X, Y, batch_size=B, epochs=1, shuffle=False, verbose=0).history, want, rtol=2e-5)
    with strategy.scope():
        model = classifier()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=[batch_rmse])
    with pytest.raises(ValueError, match=r"`batch_rmse` returns one value for a whole batch .* subclass "
                                         r"keras.metrics.Metric"):
        model.fit(X, Y, batch_size=B, epochs=1, verbose=0)


# --- TF spellings -----------------------------------------------------------------------------------
def test_tf_names_without_a_counterpart_name_the_lockstep_way():
    with pytest.raises(AttributeError, match=r"ReduceOp has no SUM_OVER_SIZE .* use `ReduceOp.MEAN`"):
        ls.ReduceOp.SUM_OVER_SIZE  # noqa: B018
    with pytest.raises(ValueError, match=r"got op='sum_over_batch_size': use `ReduceOp.MEAN`"):
        ls.ReduceOp.from_value("sum_over_batch_size")
    strategy = ls.MirroredStrategy(2)
    with pytest.raises(ValueError, match=r"plain value \(1.0\), not a distributed one, .* \(TF raises here too\)"):
        strategy.reduce("SUM", 1.0)
    assert float(strategy.reduce("MEAN", 1.0)) == 1.0 and float(strategy.reduce("SUM", 0.0)) == 0.0
    batch = next(iter(strategy.experimental_distribute_dataset([np.arange(4.0)])))

    @jax.jit
    def train_step(b):
        return strategy.run(lambda v: v * 2, args=(b,))

    with pytest.raises(ls.UsageError, match=r"Drop the `@jax.jit` decorator: `strategy.run` compiles the step"):
        train_step(batch)


def test_tf_constructors_and_resolvers_as_tf_code_writes_them(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    r = ls.TFConfigClusterResolver()  # TF: an empty cluster without TF_CONFIG
    assert (r.num_workers, r.task_type, r.task_id, r.is_chief) == (1, None, None, True)
    assert ls.MultiWorkerMirroredStrategy(cluster_resolver=r).num_workers == 1
    for ops in (ls.HierarchicalCopyAllReduce(), ls.NcclAllReduce(), ls.ReductionToOneDevice(),
                tf.distribute.HierarchicalCopyAllReduce()):
        assert ls.MirroredStrategy(2, cross_device_ops=ops).cross_device_ops is ops
    with pytest.raises(TypeError, match="`cross_device_ops` must be None or a CrossDeviceOps"):
        ls.MirroredStrategy(2, cross_device_ops="nccl")
    options = ls.experimental.CommunicationOptions(
        implementation=ls.experimental.CommunicationImplementation.NCCL, timeout_seconds=30)
    assert ls.MultiWorkerMirroredStrategy(communication_options=options).failure_timeout == 30
    central = ls.experimental.CentralStorageStrategy()
    assert central.num_replicas_in_sync == len(jax.local_devices())


def test_the_custom_training_tutorial_s_losses_and_optional_iteration_equal_one_device():
    """TF's custom-training loop: `compute_average_loss` + `scale_regularization_loss` inside `run`,
    iterated with `get_next_as_optional`: the one-device step, whatever the replicas."""
    def loss_of(params, x, y):
        logits = x @ params["w"]
        per_example = -jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y]
        return ls.compute_average_loss(per_example) + ls.scale_regularization_loss(
            [0.01 * jnp.sum(params["w"] ** 2)])

    def one_device(params):
        logits = X @ params["w"]
        return float(-np.mean(jax.nn.log_softmax(logits)[np.arange(N), Y]) + 0.01 * np.sum(params["w"] ** 2))

    params = {"w": jnp.asarray(_rng.normal(size=(8, 3)).astype("float32"))}
    want = jax.grad(lambda p: -jnp.mean(jax.nn.log_softmax(X @ p["w"])[jnp.arange(N), Y])
                    + 0.01 * jnp.sum(p["w"] ** 2))(params)["w"]
    for replicas in (1, 3, 4):
        strategy = ls.MirroredStrategy(replicas)
        it = iter(strategy.experimental_distribute_dataset(ls.data.batches((X, Y), N)))
        optional = it.get_next_as_optional()
        while optional.has_value():
            x, y = optional.get_value()
            loss, grads = strategy.run(jax.value_and_grad(loss_of), args=(params, x, y))
            np.testing.assert_allclose(float(strategy.reduce("SUM", loss)), one_device(params), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(want), rtol=1e-4, atol=1e-6)
            optional = it.get_next_as_optional()


def test_a_step_function_made_anew_each_step_is_named():
    strategy = ls.MirroredStrategy(2)
    ds = strategy.experimental_distribute_dataset(ls.data.batches(np.arange(40.0), 4))
    scale = jnp.float32(2.0)

    def train_step(batch):
        def step_fn(x):  # TF's idiom: defined inside the (tf.function) train step
            return x * scale
        return strategy.run(step_fn, args=(batch,))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in ds:
            train_step(batch)
    assert sum("`step_fn` (" in str(w.message) and "define it once" in str(w.message) for w in caught) == 1


def test_a_model_built_in_the_scope_of_a_strategy_nobody_keeps_trains_on_it_after_a_collection():
    """TF's idiom `with ls.MirroredStrategy(4).scope(): model = ...`, then `model.fit` outside: the
    model's variables keep their strategy, as TF's do. Lockstep held it weakly, so once the collector
    had freed the strategy, `fit` ran Keras' own loop (labels no longer checked: Keras' error inside
    the step, here; a test failed so now and then)."""
    with ls.MirroredStrategy(4).scope():
        model = classifier()
    gc.collect()
    with pytest.raises(ValueError, match=r"`y` has shape \(193, 2\), but the model predicts 3 classes"):
        model.fit(X, np.stack([Y, Y], 1), batch_size=B, epochs=1, verbose=0)
    want_w, want_h = keras_own_fit(model.get_weights(), epochs=1)
    history = model.fit(X, Y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_logs_close(history.history, want_h, rtol=2e-5)
    assert_weights_close(model.get_weights(), want_w, atol=5e-6)


def test_a_model_and_the_strategy_its_variables_hold_are_freed_together():
    """The variables hold their strategy (as TF's do), and the strategy's compiled steps hold the
    model: a cycle the collector frees once neither is used, after fit, evaluate and predict."""
    strategy = ls.MirroredStrategy(2)
    with strategy.scope():
        model = classifier()
    model.fit(X, Y, batch_size=B, epochs=1, verbose=0)
    model.evaluate(X, Y, batch_size=B, verbose=0)
    model.predict(X, batch_size=B, verbose=0)
    refs = weakref.ref(strategy), weakref.ref(model)
    del strategy, model
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_keras_backup_and_restore_resumes_exactly(tmp_path):
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    strategy = ls.MirroredStrategy(2)
    init = classifier().get_weights()
    want_w, want_h = keras_own_fit(init, epochs=3)
    with strategy.scope():
        model = classifier()
    model.set_weights(init)
    with pytest.raises(KeyboardInterrupt):
        model.fit(X, Y, batch_size=B, epochs=3, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path)), Interrupt()])
    with strategy.scope():
        resumed = classifier(seed=1)  # a new process's model: other weights, restored from the backup
    history = resumed.fit(X, Y, batch_size=B, epochs=3, shuffle=False, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path))])
    assert history.epoch == [0, 1, 2]  # lockstep's backups keep the History of the epochs before
    assert_logs_close(history.history, want_h, rtol=2e-5)
    assert_weights_close(resumed.get_weights(), want_w, atol=5e-6)


@pytest.mark.parametrize("replicas", variants([1, 4, 8], {4}))  # make test-full: 1 and 8 too
def test_keras_metrics_updated_inside_run_count_real_rows_once(replicas):
    """TF's custom-training tutorial: Keras metrics made in the scope, `update_state` inside the
    replica function (stateful and stateless), `result()` outside: Keras' own value on the whole data."""
    strategy = ls.MirroredStrategy(replicas)
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_loss = keras.metrics.Mean(name="test_loss")
        auc = keras.metrics.AUC()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    logits = jnp.asarray(_rng.normal(size=(N, 3)).astype("float32"))
    data = strategy.experimental_distribute_dataset(ls.data.batches((Y, logits), 24))  # last batch: 1 row

    def step(inputs):
        labels, predictions = inputs
        accuracy.update_state(labels, predictions)
        test_loss.update_state(loss_object(labels, predictions))
        auc.update_state(labels == 1, jax.nn.softmax(predictions)[:, 1])

    stateless = keras.metrics.SparseCategoricalAccuracy()
    variables = [v.value for v in stateless.variables]

    def stateless_step(variables, inputs):
        return stateless.stateless_update_state(variables, inputs[0], inputs[1])

    for epoch in range(2):  # a reset between epochs, as the tutorial's loop does
        for batch in data:
            strategy.run(step, args=(batch,))
            variables = strategy.run(stateless_step, args=(variables, batch))
        want_acc = keras.metrics.SparseCategoricalAccuracy()
        want_acc.update_state(Y, logits)
        want_auc = keras.metrics.AUC()
        want_auc.update_state(Y == 1, jax.nn.softmax(logits)[:, 1])
        assert float(accuracy.result()) == pytest.approx(float(want_acc.result()), abs=1e-7)
        assert float(test_loss.result()) == pytest.approx(float(np.mean(loss_object(Y, logits))), rel=1e-6)
        assert float(auc.result()) == pytest.approx(float(want_auc.result()), rel=1e-6)
        got = stateless.stateless_result([np.asarray(strategy.experimental_local_results(v)[0]) for v in variables])
        assert float(got) == pytest.approx(float(want_acc.result()), abs=1e-7)
        accuracy.reset_state(), test_loss.reset_state(), auc.reset_state()
        variables = [jnp.zeros_like(v.value) for v in stateless.variables]


def test_keras_metrics_in_run_keep_to_their_own_program_and_name_what_run_cannot_do():
    """Each compiled program of a step adds its own metrics' updates (a `training` flag picks
    which); a bound method compiles once; positional sample weights and metrics that shape their
    variables on a first update (F1Score) work; `result()` inside `run` is a clear error."""
    strategy = ls.MirroredStrategy(4)
    with strategy.scope():
        train_acc, test_acc = keras.metrics.SparseCategoricalAccuracy(), keras.metrics.SparseCategoricalAccuracy()
        weighted = keras.metrics.Mean()
        f1 = keras.metrics.F1Score(average="macro")
    logits = _rng.normal(size=(N, 3)).astype("float32")
    weights = _rng.uniform(0.5, 2.0, size=N).astype("float32")
    data = strategy.experimental_distribute_dataset(ls.data.batches((Y, logits, weights), 24))

    class Loop:
        def step(self, batch, training):
            labels, predictions, w = batch
            (train_acc if training else test_acc).update_state(labels, predictions)
            if training:
                weighted.update_state(labels.astype("float32"), w)  # positional sample_weight
                f1.update_state(jax.nn.one_hot(labels, 3), jax.nn.softmax(predictions))

    loop = Loop()
    for batch in data:
        for training in (True, False, True):  # train_acc sees each batch twice, test_acc once
            strategy.run(loop.step, args=(batch, training))
    want = keras.metrics.SparseCategoricalAccuracy()
    want.update_state(Y, logits)
    assert float(train_acc.result()) == pytest.approx(float(want.result()), abs=1e-7)
    assert float(test_acc.result()) == pytest.approx(float(want.result()), abs=1e-7)
    assert float(train_acc.count) == 2 * N and float(test_acc.count) == N
    assert float(weighted.result()) == pytest.approx(float(np.sum(Y * weights) / np.sum(weights)), rel=1e-6)
    want_f1 = keras.metrics.F1Score(average="macro")
    want_f1.update_state(np.eye(3)[Y], jax.nn.softmax(logits))
    assert float(f1.result()) == pytest.approx(float(want_f1.result()), rel=1e-6)
    assert strategy.extended.compile_counts(loop.step) == [1, 1]  # one program per training flag, compiled once
    with pytest.raises(ls.UsageError, match=r"`result\(\)` .* was read inside `strategy.run`"):
        strategy.run(lambda b: train_acc(b[0], b[1]), args=(next(iter(data)),))
