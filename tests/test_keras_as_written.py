"""Keras code as written: a user's own `keras.metrics.Metric` subclasses, metrics given to
`model.compile` with their arguments, and the Keras optimizer's state after training — each held
to Keras' own one-device `model.fit` (same seed, `shuffle=False`)."""

import contextlib
import os

import keras
import numpy as np
import pytest
from keras import ops

import lockstep as ls
from keras_reference import assert_logs_close, assert_weights_close, in_keras_and_lockstep
from launching import WORKERS, launch_workers, output_of, rank_results
from sharded_cases import sharded_strategy
from test_keras_layers import REFUSED_DRAWS
from test_keras_settings import on_a_generator, subclassed_compiled

FULL = pytest.mark.full_suite  # variants `make test-full` adds (CI time)
N, B = 203, 16  # 13 batches, the last of 11 rows: on 4 replicas 3, 3, 3, 2; on 3 replicas 4, 4, 3
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, 5)).astype(np.float32)
Y_VALUE = (X @ _rng.normal(size=5) + 3).astype(np.float32)
Y_CLASS = (X[:, 0] + X[:, 1] > 0).astype(np.int32) + (X[:, 2] > 0.5).astype(np.int32)
WEIGHTS = _rng.uniform(0.2, 2.0, size=N).astype(np.float32)


class RMSE(keras.metrics.Metric):
    """An RMSE written the Keras way, as the Keras guide writes custom metrics: it ignores
    `sample_weight` (so the padding rows lockstep adds must be left out another way)."""

    def __init__(self, name="rmse", **kwargs):
        super().__init__(name=name, **kwargs)
        self.sse = self.add_variable(shape=(), initializer="zeros", name="sse")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        d = ops.square(ops.cast(y_true, "float32") - ops.squeeze(y_pred, -1))
        self.sse.assign_add(ops.sum(d))
        self.count.assign_add(ops.cast(ops.shape(d)[0], "float32"))

    def result(self):
        return ops.sqrt(self.sse / self.count)


class WeightedMAE(keras.metrics.Metric):
    """A mean absolute error that honours `sample_weight`."""

    def __init__(self, name="weighted_mae", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.weight = self.add_variable(shape=(), initializer="zeros", name="weight")

    def update_state(self, y_true, y_pred, sample_weight=None):
        d = ops.abs(ops.cast(y_true, "float32") - ops.squeeze(y_pred, -1))
        w = ops.ones_like(d) if sample_weight is None else ops.cast(sample_weight, "float32")
        self.total.assign_add(ops.sum(d * w))
        self.weight.assign_add(ops.sum(w))

    def result(self):
        return self.total / self.weight


class RunningMax(keras.metrics.Metric):
    """The largest prediction seen: a maximum, not a sum over rows."""

    def __init__(self, name="running_max", **kwargs):
        super().__init__(name=name, **kwargs)
        self.top = self.add_variable(shape=(), initializer="zeros", name="top")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.top.assign(ops.maximum(self.top, ops.max(y_pred)))

    def result(self):
        return self.top + 0


def regressor(metrics=(), weighted_metrics=None, optimizer=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse", metrics=list(metrics),
                  weighted_metrics=weighted_metrics)
    return model


def classifier(metrics=("accuracy",)):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=list(metrics))
    return model


# n=194: a last batch of 2 rows, which leaves two of 4 replicas with none
@pytest.mark.parametrize("replicas, n", [pytest.param(1, N, marks=FULL), (3, N), pytest.param(4, N, marks=FULL),
                                         (4, 194)])
@pytest.mark.parametrize("weighted", [False, True])
def test_custom_keras_metrics_equal_keras_own_fit_and_evaluate(replicas, n, weighted):
    """Before: logged as `mean_metric_wrapper` with other values (RMSE 3.878 on 4 replicas, Keras
    3.972), and `evaluate` raised UnexpectedTracerError."""
    x, y = X[:n], Y_VALUE[:n]
    sw = dict(sample_weight=WEIGHTS[:n]) if weighted else {}

    def compiled():  # Keras weighs only `weighted_metrics` by sample_weight: lockstep too, for a compiled model
        return regressor([RMSE(), WeightedMAE()], weighted_metrics=[WeightedMAE(name="wmae"), "mae"])

    keras_model = compiled()
    want = keras_model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, **sw).history
    want_eval = keras_model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True, **sw)
    t = ls.Trainer(compiled(), strategy=ls.MirroredStrategy(replicas))
    got = t.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, **sw).history
    assert_logs_close(got, want)
    assert_logs_close(t.evaluate(x, y, batch_size=B, verbose=0, **sw), want_eval)
    assert_weights_close(t.get_weights(), keras_model.get_weights())


class Count(keras.metrics.Metric):
    """Counts the samples it sees, ignoring `sample_weight` (in the `dtype` asked: an int32 counter too)."""

    def __init__(self, name="count", dtype="float32", **kwargs):
        super().__init__(name=name, **kwargs)
        self.kind = dtype
        self.n = self.add_variable(shape=(), initializer="zeros", name="n", dtype=dtype)

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.n.assign_add(ops.cast(ops.shape(y_true)[0], self.kind))

    def result(self):
        return ops.cast(self.n, "float32")


class LowestError(keras.metrics.Metric):
    """The smallest absolute error seen, from +inf: a minimum that starts elsewhere than zero."""

    def __init__(self, name="lowest_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.low = self.add_variable(shape=(), initializer=keras.initializers.Constant(np.inf), name="low")

    def update_state(self, y_true, y_pred, sample_weight=None):
        err = ops.abs(ops.cast(y_true, "float32") - ops.squeeze(y_pred, -1))
        self.low.assign(ops.minimum(self.low, ops.min(err)))

    def reset_state(self):  # Keras' own would zero it
        self.low.assign(np.inf)

    def result(self):
        return self.low + 0


class LargestTarget(keras.metrics.Metric):
    """The largest target seen, from zero: on a probe row whose target is 0 a maximum looks like a
    sum unless the row is seen twice."""

    def __init__(self, name="largest_target", **kwargs):
        super().__init__(name=name, **kwargs)
        self.top = self.add_variable(shape=(), initializer="zeros", name="top")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.top.assign(ops.maximum(self.top, ops.max(ops.cast(y_true, "float32"))))

    def result(self):
        return self.top + 0


class LastBatchSize(keras.metrics.Metric):
    """The size of the last batch seen: no sum, maximum or minimum of the rows."""

    def __init__(self, name="last_batch_size", **kwargs):
        super().__init__(name=name, **kwargs)
        self.last = self.add_variable(shape=(), initializer="zeros", name="last")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.last.assign(ops.cast(ops.shape(y_true)[0], "float32"))

    def result(self):
        return self.last + 0


def counting_metrics():
    return [Count(), Count("int_count", dtype="int32"), RunningMax(), LowestError(), LargestTarget()]


# the 50 samples at batch 5 (its 4 replicas counted 80), N prime, a last batch shorter than the replicas
@pytest.mark.parametrize("replicas, n, batch", [(4, 50, 5), (3, 31, 4), (8, 18, 5), pytest.param(2, 1, 3, marks=FULL)])
def test_counts_maxima_and_integer_states_see_only_real_rows_in_fit_evaluate_and_validation(replicas, n, batch):
    """Before: a count over samples counted the padding rows in evaluate and validation (50 rows at
    batch 5 on 4 replicas: 80); a running maximum or minimum was refused."""
    x, y = X[:n], Y_VALUE[:n]
    val = (X[-n - 7:], Y_VALUE[-n - 7:])
    keras_model = regressor(counting_metrics())
    want_eval = keras_model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    want = keras_model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, validation_data=val).history
    strategy = ls.MirroredStrategy(replicas)
    with strategy.scope():
        model = regressor(counting_metrics())
    got_eval = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    got = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, validation_data=val).history
    assert got_eval["count"] == got_eval["int_count"] == n
    assert got["val_count"] == got["val_int_count"] == [n + 7] * 2
    assert_logs_close(got_eval, want_eval)
    assert_logs_close(got, want)


def test_a_custom_metric_that_cannot_be_combined_is_refused_naming_its_variable():
    model = regressor([LastBatchSize()])
    t = ls.Trainer(model, strategy=ls.MirroredStrategy(4))
    with pytest.raises(ValueError, match=r"Keras metric `last_batch_size` \(LastBatchSize\) cannot be combined exactly "
                                         r"across batches, replicas and workers: its variable `last` after one batch "
                                         r"of both rows is 2.0 .* neither the sum .* nor the maximum or minimum"):
        t.fit(X, Y_VALUE, batch_size=B, epochs=1, verbose=0)
    assert model(X[:3]).shape == (3, 1)  # the Keras model is left as it was
    assert model.get_weights()[0].shape == (5, 8)


def test_metrics_given_to_compile_keep_their_arguments():
    """Before: `ls.metrics.F1Score(average="macro")` given to compile came back per class."""
    t = ls.Trainer(classifier([ls.metrics.F1Score(average="macro"), ls.metrics.F1Score(average="weighted")]),
                   strategy=ls.MirroredStrategy(3))
    logs = t.fit(X, Y_CLASS, batch_size=B, epochs=1, verbose=0).history
    assert np.shape(logs["f1_score"][0]) == () and np.shape(logs["f1_score_1"][0]) == ()
    from sklearn.metrics import f1_score

    pred = t.predict(X, batch_size=B).argmax(-1)
    got = t.evaluate(X, Y_CLASS, batch_size=B, verbose=0)
    np.testing.assert_allclose(got["f1_score"], f1_score(Y_CLASS, pred, average="macro"), rtol=1e-5)
    np.testing.assert_allclose(got["f1_score_1"], f1_score(Y_CLASS, pred, average="weighted"), rtol=1e-5)


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=FULL), 4])
def test_the_keras_optimizer_holds_the_trained_state_and_a_saved_model_resumes_exactly(replicas, tmp_path):
    """Before: after `Trainer.fit`, `model.optimizer.iterations` stayed 0 and `model.save` wrote
    all-zero Adam moments; resuming from the file ended 0.015 away from continuing in memory."""
    keras_model = classifier()
    keras_model.fit(X, Y_CLASS, batch_size=B, epochs=2, shuffle=False, verbose=0)
    model = classifier()
    t = ls.Trainer(model, strategy=ls.MirroredStrategy(replicas))
    t.fit(X, Y_CLASS, batch_size=B, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == t.train_state.global_step == int(keras_model.optimizer.iterations) == 26
    assert_weights_close([np.asarray(v) for v in model.optimizer.variables],
                         [np.asarray(v) for v in keras_model.optimizer.variables])
    model.save(tmp_path / "m.keras")
    t.save(str(tmp_path / "t.keras"))

    t.fit(X, Y_CLASS, batch_size=B, epochs=1, shuffle=False, verbose=0)  # one more epoch in memory
    keras_model.fit(X, Y_CLASS, batch_size=B, epochs=1, shuffle=False, verbose=0)
    for name in ("m.keras", "t.keras"):
        loaded = keras.models.load_model(tmp_path / name)
        assert int(loaded.optimizer.iterations) == 26
        resumed = ls.Trainer(loaded, strategy=ls.MirroredStrategy(replicas))
        resumed.fit(X, Y_CLASS, batch_size=B, epochs=1, shuffle=False, verbose=0)
        assert_weights_close(resumed.get_weights(), t.get_weights(), atol=1e-6)
        assert_weights_close(resumed.get_weights(), keras_model.get_weights(), atol=1e-5)


def mixed_float16_classifier():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = classifier()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                                                    dynamic_growth_steps=5),
                      loss="sparse_categorical_crossentropy")
    finally:
        keras.config.set_dtype_policy("float32")
    return model


def test_the_loss_scale_of_mixed_float16_round_trips_through_the_keras_optimizer(tmp_path):
    """Before: the Keras LossScaleOptimizer was left unbuilt (no `dynamic_scale`), so a saved model
    restarted its loss scale from 2**15."""
    keras_model = mixed_float16_classifier()
    keras_model.fit(X, Y_CLASS, batch_size=B, epochs=2, shuffle=False, verbose=0)
    with ls.MirroredStrategy(4).scope():
        model = mixed_float16_classifier()
    model.fit(X, Y_CLASS, batch_size=B, epochs=2, shuffle=False, verbose=0)
    for opt in (model.optimizer, keras_model.optimizer):  # 26 steps: the scale doubled every 5 finite ones, and
        # halved twice where float16 gradients overflowed (those 2 steps skipped): as Keras does
        assert (float(opt.dynamic_scale.value), int(opt.step_counter.value), int(opt.iterations)) == (2.0**17, 2, 24)
    model.save(tmp_path / "m.keras")
    model.fit(X, Y_CLASS, batch_size=B, epochs=1, shuffle=False, verbose=0)  # one more epoch in memory
    resumed = ls.Trainer(keras.models.load_model(tmp_path / "m.keras"), strategy=ls.MirroredStrategy(4))
    resumed.fit(X, Y_CLASS, batch_size=B, epochs=1, shuffle=False, verbose=0)
    resumed.sync_model()
    assert float(resumed.model.optimizer.dynamic_scale.value) == float(model.optimizer.dynamic_scale.value)
    assert int(resumed.model.optimizer.iterations) == int(model.optimizer.iterations) > 24
    assert_weights_close(resumed.get_weights(), model.get_weights(), atol=0)


class OptimizerReadings(keras.callbacks.Callback):
    """What a Keras callback reads of the optimizer after every batch: its loss scale, finite steps
    since the scale changed, iterations and (scheduled) learning rate."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        o = self.model.optimizer
        self.seen.append((float(o.dynamic_scale.numpy()), int(o.step_counter.numpy()), int(o.iterations.numpy()),
                          float(np.asarray(o.learning_rate))))


def test_a_callback_reads_the_optimizer_as_in_keras_own_fit_in_a_second_fit_under_loss_scaling():
    """Before: in a second `fit` a Keras callback read `iterations` from 1 again (and the scheduled
    learning rate at it), counting the steps skipped for overflowing float16 gradients, which Keras
    does not; and `dynamic_scale` / `step_counter` as the last save left them."""
    def model():
        keras.config.set_dtype_policy("mixed_float16")
        try:
            m = classifier()
            rate = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=3, decay_rate=0.5)
            m.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(rate),
                                                                    dynamic_growth_steps=5),
                      loss="sparse_categorical_crossentropy")
        finally:
            keras.config.set_dtype_policy("float32")
        return m

    got = {}
    for name, strategy in (("keras", None), ("lockstep", ls.MirroredStrategy(4))):
        with strategy.scope() if strategy else contextlib.nullcontext():
            m = model()
        m.fit(X[:194], Y_CLASS[:194], batch_size=B, epochs=1, shuffle=False, verbose=0)  # the last batch: 2 rows
        got[name] = OptimizerReadings()
        m.fit(X[:194], Y_CLASS[:194], batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[got[name]])
    want = got["keras"].seen
    assert len(want) == 26 and want[0][2] < 26 and len({s for s, *_ in want}) > 2  # steps skipped; the scale moved
    assert [r[:3] for r in got["lockstep"].seen] == [r[:3] for r in want]
    np.testing.assert_allclose([r[3] for r in got["lockstep"].seen], [r[3] for r in want], rtol=1e-6)


class ChiefReadsMetrics(keras.callbacks.Callback):
    """Worker 0 alone reads the model's metric objects and `get_metrics_result` as each epoch and
    batch begins (no hook at a batch's end: the metrics are read from the batch before; reset,
    `LowestError`'s own `reset_state` too, before the first)."""

    def __init__(self):
        super().__init__()
        self.read = []

    def on_epoch_begin(self, batch, logs=None):
        import jax

        if jax.process_index() == 0:
            metrics = self.model.metrics
            self.read.append([float(metrics[0].result()), *map(float, self.model.get_metrics_result().values())])
    on_train_batch_begin = on_test_batch_begin = on_epoch_begin


class ChangesMetricObjects(keras.callbacks.Callback):
    """Every worker's hooks change the model's metric objects as Keras code may (windows of them):
    the compiled metrics (a user's RMSE, counts, a running maximum and `LowestError`'s minimum)
    reset after every third call, the loss tracker given 1.0 more as every fourth batch begins,
    every object reset after an evaluation's second batch."""

    def __init__(self):
        super().__init__()
        self.ends = 0

    def on_train_batch_end(self, batch, logs=None):
        self.ends += 1
        if self.ends % 3 == 0:
            self.model.metrics[-1].reset_state()

    def on_train_batch_begin(self, batch, logs=None):
        if batch % 4 == 3:
            self.model.metrics[0].update_state(1.0)

    def on_test_batch_end(self, batch, logs=None):
        if batch == 1:
            for metric in self.model.metrics:
                metric.reset_state()


@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # Keras' own, at a generator's end
@pytest.mark.xdist_group("processes")  # a 2-worker launch (about 16 s)
def test_on_two_workers_custom_metrics_and_the_optimizer_state_equal_keras_own_fit(tmp_path):
    """Also, on the same two workers: a subclassed model made in the scope and first used on a
    generator equals Keras' own fit / evaluate / predict, and MixUp and a JaxLayer drawing with its
    rng are refused on both workers alike, as is a fit given a non-callback on worker 1 alone; and
    worker 0 alone reading the metric objects as every batch begins reads Keras' values, and no worker waits."""
    script = WORKERS / "keras_custom_metrics_job.py"
    proc = launch_workers(script, devices=2)
    assert proc.returncode == 0, output_of(proc)
    results = rank_results(proc, 2)
    keras_model = regressor([RMSE(), *counting_metrics()], weighted_metrics=[WeightedMAE()],
                            optimizer=keras.optimizers.Adam(0.01))
    reads = ChiefReadsMetrics()
    want = keras_model.fit(X[:194], Y_VALUE[:194], batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[reads],
                           sample_weight=WEIGHTS[:194], validation_data=(X[194:], Y_VALUE[194:]))
    chief = [got["reads"] for got in results if got["reads"]]  # (the workers' lines in either order)
    assert len(reads.read) == 30 and len(chief) == 1 and np.isinf(reads.read[0]).any()
    np.testing.assert_allclose(chief[0], reads.read, rtol=2e-5, atol=1e-6)
    windows = regressor([RMSE(), *counting_metrics()], weighted_metrics=[WeightedMAE()]).fit(
        X[:194], Y_VALUE[:194], batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[ChangesMetricObjects()],
        sample_weight=WEIGHTS[:194], validation_data=(X[194:], Y_VALUE[194:])).history
    assert windows["count"] != [194, 194]  # Keras' logs show the windows
    for got in results:
        assert_logs_close(got["windows"], windows)
    want_eval = keras_model.evaluate(X[:194], Y_VALUE[:194], batch_size=16, verbose=0, return_dict=True)
    want_stopped = keras_model.evaluate(X[:194], Y_VALUE[:194], batch_size=16, verbose=0, return_dict=True,
                                        callbacks=[StopAfter(2)])
    assert want_stopped["int_count"] == 48  # 3 batches of 16
    for got in results:
        assert_logs_close(got["stopped"], want_stopped)  # worker 0 alone asked to stop: both stopped there
        assert got["history"]["val_count"] == [N - 194] * 2 and got["evaluate"]["int_count"] == 194
        assert_logs_close(got["history"], want.history)
        assert_logs_close(got["evaluate"], want_eval)
        assert got["iterations"] == int(keras_model.optimizer.iterations) == 26
        assert_weights_close([np.asarray(v) for v in got["optimizer"]],
                             [np.asarray(v) for v in keras_model.optimizer.variables], atol=1e-5)
        assert_weights_close([np.asarray(w) for w in got["weights"]], keras_model.get_weights(), atol=1e-5)
    # a subclassed model made in the scope, first used on a generator: built on its first batch as Keras builds it
    sub = subclassed_compiled()  # Keras alone, one device
    want_generated = {call: on_a_generator(sub, call) for call in ("fit", "evaluate", "predict")}
    for got in results:
        assert_logs_close(got["generated"]["fit"], want_generated["fit"])
        assert_logs_close(got["generated"]["evaluate"], want_generated["evaluate"])
        np.testing.assert_allclose(got["generated"]["predict"], want_generated["predict"], rtol=1e-5, atol=1e-6)
        assert_weights_close([np.asarray(w) for w in got["generated"]["weights"]], sub.get_weights())
        # draws a replica cannot make as one device: refused on both workers alike (neither hangs)
        for name, message in got["refused"].items():
            if name in REFUSED_DRAWS:
                assert message is not None and REFUSED_DRAWS[name][1] in message, (name, message)
    assert sorted(got["refused"]["not a callback"] for got in results) == [  # (the ranks print in any order)
        "`callbacks` must hold lockstep callback objects (lockstep.Trainer takes Keras callbacks too), got dict.",
        "`callbacks` must hold lockstep callback objects (lockstep.Trainer takes Keras callbacks too), got one that "
        "is not on another worker of the job (it names it)."]


class StopAfter(keras.callbacks.Callback):
    """Ends Keras' evaluate after batch `at` (`stop_evaluating`)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_test_batch_end(self, batch, logs=None):
        if batch == self.at:
            self.model.stop_evaluating = True


class EpochRecorder(keras.callbacks.Callback):
    """A user's own Keras callback: records what it sees and stops at a loss it likes."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append((epoch, round(float(logs["val_loss"]), 5), float(self.model.optimizer.learning_rate)))


def keras_callbacks(path):
    return [keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.05, patience=2, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_delta=0.05),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9 if epoch >= 3 else lr),
            keras.callbacks.TerminateOnNaN(), keras.callbacks.CSVLogger(str(path / "log.csv")),
            keras.callbacks.ModelCheckpoint(str(path / "best.keras"), monitor="val_loss", save_best_only=True),
            EpochRecorder()]


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=FULL), 3, pytest.param(4, marks=FULL)])
def test_keras_callbacks_as_written_decide_and_write_as_in_keras_own_fit(replicas, tmp_path):
    """Before: every keras.callbacks object was refused ("`callbacks` must hold lockstep.callbacks.Callback
    objects, got ModelCheckpoint")."""
    (tmp_path / "keras").mkdir()
    (tmp_path / "ls").mkdir()
    kw = dict(batch_size=B, epochs=12, shuffle=False, verbose=0, validation_data=(X[:40], Y_VALUE[:40]))
    keras_model = regressor(optimizer=keras.optimizers.Adam(0.2))
    want_cbs = keras_callbacks(tmp_path / "keras")
    want = keras_model.fit(X[40:], Y_VALUE[40:], callbacks=want_cbs, **kw).history
    model = regressor(optimizer=keras.optimizers.Adam(0.2))
    got_cbs = keras_callbacks(tmp_path / "ls")
    got = ls.Trainer(model, strategy=ls.MirroredStrategy(replicas)).fit(X[40:], Y_VALUE[40:], callbacks=got_cbs,
                                                                        **kw).history
    assert len(want["loss"]) < 12  # early stopping stopped it, at the same epoch here
    assert_logs_close(got, want)
    assert got_cbs[0].stopped_epoch == want_cbs[0].stopped_epoch and got_cbs[0].best_epoch == want_cbs[0].best_epoch
    assert [s[0] for s in got_cbs[-1].seen] == [s[0] for s in want_cbs[-1].seen]
    np.testing.assert_allclose([s[1:] for s in got_cbs[-1].seen], [s[1:] for s in want_cbs[-1].seen], rtol=1e-5)
    assert_weights_close(model.get_weights(), keras_model.get_weights(), atol=1e-5)  # the restored best weights
    got_csv, want_csv = (np.genfromtxt(tmp_path / d / "log.csv", delimiter=",", names=True) for d in ("ls", "keras"))
    assert got_csv.dtype.names == want_csv.dtype.names
    for name in want_csv.dtype.names:
        np.testing.assert_allclose(got_csv[name], want_csv[name], rtol=1e-5, atol=1e-7)
    best = keras.models.load_model(tmp_path / "ls" / "best.keras")
    assert_weights_close(best.get_weights(), keras.models.load_model(tmp_path / "keras" / "best.keras").get_weights(),
                         atol=1e-5)


def test_callbacks_and_the_history_get_keras_params():
    """Before: a Keras callback's `self.params` stayed None, and lockstep's History had no `params`."""
    class Reader(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seen = dict(self.params)

    kw = dict(batch_size=B, epochs=2, verbose=0, shuffle=False)
    want_reader, got_reader = Reader(), Reader()
    want = regressor().fit(X, Y_VALUE, callbacks=[want_reader], **kw)
    with ls.MirroredStrategy(3).scope():
        got = regressor().fit(X, Y_VALUE, callbacks=[got_reader], **kw)
    assert got_reader.seen == want_reader.seen == got.params == want.params == {"verbose": 0, "epochs": 2, "steps": 13}


class StopAt(keras.callbacks.Callback):
    """A crash at the start of an epoch (after the previous epoch's backup)."""

    def __init__(self, epoch):
        super().__init__()
        self.at = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("at", [3, pytest.param(5, marks=FULL)])
def test_keras_callbacks_bookkeeping_resumes_from_a_lockstep_backup(at, tmp_path):
    """Before: a resume from lockstep's BackupAndRestore restarted Keras' EarlyStopping and
    ReduceLROnPlateau from zero (their `wait` and `best`), so the resumed run stopped later."""
    kw = dict(batch_size=B, epochs=12, shuffle=False, verbose=0, validation_data=(X[:40], Y_VALUE[:40]))

    def callbacks():
        return [keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.05, patience=2, restore_best_weights=True),
                keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_delta=0.05),
                EpochRecorder()]

    keras_model = regressor(optimizer=keras.optimizers.Adam(0.2))
    want_cbs = callbacks()
    want = keras_model.fit(X[40:], Y_VALUE[40:], callbacks=want_cbs, **kw).history
    assert at < len(want["loss"]) < 12
    with ls.MirroredStrategy(3).scope():
        model = regressor(optimizer=keras.optimizers.Adam(0.2))
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(X[40:], Y_VALUE[40:], callbacks=[ls.callbacks.BackupAndRestore(tmp_path), *callbacks(), StopAt(at)],
                  **kw)
    with ls.MirroredStrategy(3).scope():  # a new process would build the model again
        model = regressor(optimizer=keras.optimizers.Adam(0.2))
    got_cbs = callbacks()
    got = model.fit(X[40:], Y_VALUE[40:], callbacks=[ls.callbacks.BackupAndRestore(tmp_path), *got_cbs], **kw).history
    assert_logs_close(got, want)
    assert got_cbs[0].stopped_epoch == want_cbs[0].stopped_epoch and got_cbs[0].best_epoch == want_cbs[0].best_epoch
    assert [s[0] for s in got_cbs[-1].seen] == [s[0] for s in want_cbs[-1].seen]  # the user's own list, resumed too
    assert_weights_close(model.get_weights(), keras_model.get_weights(), atol=1e-5)


def test_every_batch_hook_is_called_as_keras_calls_it():
    """Before: `on_test_batch_begin` and `on_predict_batch_begin` were never called."""
    class Counter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.calls = {}

        def _count(self, name):
            self.calls[name] = self.calls.get(name, 0) + 1

        def on_test_batch_begin(self, batch, logs=None):
            self._count(f"test_begin_{batch}")

        def on_test_batch_end(self, batch, logs=None):
            self._count("test_end")

        def on_predict_batch_begin(self, batch, logs=None):
            self._count(f"predict_begin_{batch}")

        def on_predict_batch_end(self, batch, logs=None):
            self._count("predict_end")

    want, got = Counter(), Counter()
    keras_model = regressor()
    keras_model.evaluate(X, Y_VALUE, batch_size=B, verbose=0, callbacks=[want])
    keras_model.predict(X, batch_size=B, verbose=0, callbacks=[want])
    with ls.MirroredStrategy(4).scope():
        model = regressor()
    model.evaluate(X, Y_VALUE, batch_size=B, verbose=0, callbacks=[got])
    model.predict(X, batch_size=B, verbose=0, callbacks=[got])
    assert got.calls == want.calls and want.calls["test_end"] == 13


def test_the_tf_distribute_surface_a_tf_user_reaches_for():
    """Before: AttributeError for each of these."""
    s = ls.MirroredStrategy(4)
    assert len(s.extended.worker_devices) == 4 and s.extended.parameter_devices == s.extended.worker_devices
    assert s.extended.should_checkpoint and s.extended.should_save_summary  # one process: worker 0
    assert not ls.has_strategy() and not ls.in_cross_replica_context()
    with s.scope():
        assert ls.has_strategy() and ls.in_cross_replica_context()
        inside = s.run(lambda: np.float32(ls.in_cross_replica_context()))
    assert not any(np.asarray(v) for v in s.experimental_local_results(inside))


def test_a_keras_distribution_that_lockstep_would_ignore_is_refused():
    """Before: with a keras.distribution.ModelParallel layout set, ls.Trainer silently ran replicated."""
    devices = keras.distribution.list_devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch"))
    try:
        model = regressor()
        with pytest.raises(ValueError, match=r"a keras.distribution setting is active \(ModelParallel\): lockstep "
                                             r"places the model itself and would ignore its layouts"):
            ls.Trainer(model, strategy=ls.MirroredStrategy(2))
    finally:
        keras.distribution.set_distribution(None)
    assert model(X[:3]).shape == (3, 1)


# n=186: 146 training rows, whose last batch of 2 rows leaves two of 4 replicas with none
@pytest.mark.parametrize("replicas, n", [pytest.param(1, N, marks=FULL), pytest.param(3, N, marks=FULL),
                                         pytest.param(4, N, marks=FULL), (4, 186)])
def test_model_fit_evaluate_and_predict_as_written_equal_keras_own(replicas, n):
    """Seed 004's way: build and compile in the scope, then Keras' own `model.fit` (was refused;
    `class_weight` was an unexpected keyword)."""
    x, y = X[:n], Y_CLASS[:n]
    kw = dict(batch_size=B, epochs=3, shuffle=False, verbose=0, validation_data=(x[:40], y[:40]),
              class_weight={0: 1.0, 1: 2.0, 2: 0.5})
    keras_model = classifier()  # no lockstep scope: Keras' own fit on one device
    want = keras_model.fit(x[40:], y[40:], **kw)
    with ls.MirroredStrategy(replicas).scope():
        model = classifier()
    got = model.fit(x[40:], y[40:], **kw)
    assert isinstance(got, ls.callbacks.History) and not isinstance(want, ls.callbacks.History)  # run by lockstep
    assert_logs_close(got.history, want.history)
    assert got.epoch == want.epoch == [0, 1, 2]
    assert_weights_close(model.get_weights(), keras_model.get_weights(), atol=1e-5)
    assert int(model.optimizer.iterations) == int(keras_model.optimizer.iterations)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), keras_model.evaluate(x, y, verbose=0),
                               rtol=1e-5)
    assert_logs_close(model.evaluate(x, y, verbose=0, return_dict=True),
                      keras_model.evaluate(x, y, verbose=0, return_dict=True))
    np.testing.assert_allclose(model.predict(x, batch_size=B, verbose=0), keras_model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.predict_on_batch(x[:7]), keras_model.predict_on_batch(x[:7]), rtol=1e-5, atol=1e-6)
    # a later fit goes on from there, as Keras' does
    more = dict(kw, epochs=1)
    assert_logs_close(model.fit(x[40:], y[40:], **more).history,
                      keras_model.fit(x[40:], y[40:], **more).history)
    assert_weights_close(model.get_weights(), keras_model.get_weights(), atol=1e-5)


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=FULL), pytest.param(3, marks=FULL), 4])
def test_validation_freq_validation_steps_and_evaluate_steps_as_in_keras(replicas):
    """Before: `validation_freq`, `validation_steps` and `evaluate(steps=)` were refused."""
    val = (X[:45], Y_CLASS[:45])  # 3 batches of 16, the last of 13: validation_steps=2 reads 32 rows
    runs = [dict(validation_freq=2, epochs=5), dict(validation_freq=[1, 4], epochs=4, validation_steps=2)]
    for kw in runs:
        keras_model = classifier()
        want = keras_model.fit(X[45:], Y_CLASS[45:], batch_size=B, shuffle=False, verbose=0, validation_data=val, **kw)
        with ls.MirroredStrategy(replicas).scope():
            model = classifier()
        got = model.fit(X[45:], Y_CLASS[45:], batch_size=B, shuffle=False, verbose=0, validation_data=val, **kw)
        assert_logs_close(got.history, want.history)
        assert len(got.history["val_loss"]) == 2  # validated after epochs 2 and 4, or 1 and 4
        np.testing.assert_allclose(model.evaluate(X, Y_CLASS, batch_size=B, steps=3, verbose=0),
                                   keras_model.evaluate(X, Y_CLASS, batch_size=B, steps=3, verbose=0), rtol=1e-5)


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=FULL), pytest.param(3, marks=FULL), 4])
def test_train_on_batch_and_test_on_batch_in_a_loop_equal_keras_own(replicas):
    """Before: refused. A hand-written loop over batches (the last of 3 rows: on 4 replicas one holds none)."""
    keras_model = classifier()
    with ls.MirroredStrategy(replicas).scope():
        model = classifier()
    for lo in range(0, 83, 16):
        batch = (X[lo:lo + 16][:83 - lo], Y_CLASS[lo:lo + 16][:83 - lo])
        kw = dict(class_weight={0: 1.0, 1: 2.0, 2: 0.5}) if lo == 32 else {}
        np.testing.assert_allclose(model.train_on_batch(*batch, **kw), keras_model.train_on_batch(*batch, **kw),
                                   rtol=1e-5)
    assert int(model.optimizer.iterations) == int(keras_model.optimizer.iterations) == 6
    assert_weights_close(model.get_weights(), keras_model.get_weights(), atol=1e-5)
    assert_weights_close(model.optimizer.variables, keras_model.optimizer.variables, atol=1e-5)
    assert_logs_close(model.test_on_batch(X[:5], Y_CLASS[:5], sample_weight=WEIGHTS[:5], return_dict=True),
                      keras_model.test_on_batch(X[:5], Y_CLASS[:5], sample_weight=WEIGHTS[:5], return_dict=True))
    assert_logs_close(model.train_on_batch(X[:7], Y_CLASS[:7], return_dict=True),
                      keras_model.train_on_batch(X[:7], Y_CLASS[:7], return_dict=True))


def test_a_generator_function_is_read_anew_every_epoch():
    """Before: refused ("`x` must be arrays or an iterable of batches, got function"); Keras refuses it too,
    and a generator object is used up after one pass (lockstep then says so)."""
    def batches(n=N):
        for lo in range(0, n, B):
            yield X[lo:min(lo + B, n)], Y_VALUE[lo:min(lo + B, n)]

    def validation():
        yield from batches(50)

    keras_model = regressor()
    want = keras_model.fit(X, Y_VALUE, batch_size=B, epochs=3, shuffle=False, verbose=0,
                           validation_data=(X[:50], Y_VALUE[:50]))
    with ls.MirroredStrategy(4).scope():
        model = regressor()
    got = model.fit(batches, epochs=3, verbose=0, validation_data=validation)
    assert_logs_close(got.history, want.history)
    assert_weights_close(model.get_weights(), keras_model.get_weights(), atol=1e-5)
    np.testing.assert_allclose(model.evaluate(batches, verbose=0), keras_model.evaluate(X, Y_VALUE, verbose=0),
                               rtol=1e-5)


def test_what_lockstep_cannot_run_as_keras_does_is_refused_and_the_model_left_whole():
    """Before: a refused `predict` left the Keras model broken (`model(x)`: 'NoneType' object is not callable)."""
    with ls.MirroredStrategy(4).scope():
        model = classifier()
    with pytest.raises(ValueError, match=r"`sample_weight` and `class_weight` cannot be specified at the same time"):
        model.train_on_batch(X[:8], Y_CLASS[:8], sample_weight=WEIGHTS[:8], class_weight={0: 1.0, 1: 1.0, 2: 1.0})
    with pytest.raises(ValueError, match=r"`validation_freq` must be a positive integer .* got validation_freq=0"):
        model.fit(X, Y_CLASS, validation_data=(X, Y_CLASS), validation_freq=0, verbose=0)
    with pytest.raises(ValueError, match=r"`steps` must be a positive integer .* got steps=0"):
        model.predict(X, steps=0, verbose=0)
    assert model(X[:3]).shape == (3, 3)
    assert model.predict(X[:5], verbose=0).shape == (5, 3)
    plain = classifier()  # built outside any lockstep scope: Keras' own methods, untouched
    assert isinstance(plain.train_on_batch(X[:8], Y_CLASS[:8]), list)


def test_a_metric_given_both_plain_and_weighted_is_named_as_keras_names_it():
    """`metrics=["accuracy"], weighted_metrics=["accuracy"]`: Keras logs `weighted_accuracy` (it was
    `accuracy_1` here, so `EarlyStopping(monitor="weighted_accuracy")` never found it)."""
    def build():
        model = classifier()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      weighted_metrics=["accuracy"])
        return model

    want = build().fit(X, Y_CLASS, sample_weight=WEIGHTS, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    with ls.MirroredStrategy(4).scope():
        model = build()
    got = model.fit(X, Y_CLASS, sample_weight=WEIGHTS, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    assert sorted(got) == sorted(want) == ["accuracy", "loss", "weighted_accuracy"]
    assert_logs_close(got, want, rtol=2e-5)


def test_callbacks_read_and_assign_the_optimizer_as_in_keras():
    """`self.model.optimizer.iterations` counts the steps so far (it read 0), and `learning_rate`
    answers `.numpy()` and `.assign(...)` (it was a float: `'float' object has no attribute`)."""
    class Halve(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(int(self.model.optimizer.iterations))

        def on_epoch_end(self, epoch, logs=None):
            lr = self.model.optimizer.learning_rate
            self.seen.append(round(float(lr.numpy()), 7))
            lr.assign(lr * 0.5)

    def run(model):
        halve = Halve()
        return model.fit(X, Y_CLASS, batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[halve]).history, halve.seen
    ((want_h, want_seen), want_w), ((got_h, got_seen), got_w) = in_keras_and_lockstep(classifier, run,
                                                                                      ls.MirroredStrategy(4))
    assert got_seen == want_seen and want_seen[:2] == [1, 2] and want_seen[13] == 0.001
    assert_logs_close(got_h, want_h, rtol=2e-5)
    assert_weights_close(got_w, want_w, atol=5e-6)


class WritesWeights(keras.callbacks.Callback):
    """A user's callback that reads and writes the model's variables during `fit`, as Keras users
    do (weight clipping, re-initialising a layer, nudging a bias): assign, assign_add and a read."""

    def __init__(self):
        super().__init__()
        self.read = []

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            kernel = self.model.layers[0].kernel
            kernel.assign(ops.clip(kernel, -0.3, 0.3))

    def on_epoch_end(self, epoch, logs=None):
        self.read.append(np.asarray(self.model.layers[1].kernel.numpy()).copy())
        self.model.layers[0].bias.assign(np.full((8,), 0.05 * (epoch + 1), np.float32))
        self.model.layers[1].kernel.assign_add(np.full((8, 1), 0.01, np.float32))


def _zero3():
    return sharded_strategy((2, 4), 3, {".*dense.*/kernel": (None, "model")}, max_replicated_fraction=0.9,
                            min_shard_size=1)


@pytest.mark.parametrize("strategy", [lambda: ls.MirroredStrategy(1), lambda: ls.MirroredStrategy(4),
                                      pytest.param(_zero3, id="zero3")])
def test_what_a_callback_assigns_to_keras_variables_is_the_next_steps_weights(strategy):
    """Before: `layer.bias.assign(...)` from a callback was discarded, and a read gave the weights
    as they were before `fit`."""
    keras_model, keras_writer = regressor(), WritesWeights()
    want = keras_model.fit(X, Y_VALUE, batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[keras_writer])
    with (s := strategy()).scope():
        model = regressor()
    writer = WritesWeights()
    got = model.fit(X, Y_VALUE, batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[writer])
    assert_logs_close(got.history, want.history)
    assert_weights_close(writer.read, keras_writer.read)
    assert_weights_close(model.get_weights(), keras_model.get_weights())


class WritesThenSaves(WritesWeights):
    """Assigns in a hook, then saves the weights in the same hook (a user's checkpointing callback
    after clipping, say): Keras saves what was assigned, and trains on from it."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.model.save_weights(os.path.join(self.directory, f"{epoch}.weights.h5"))


@pytest.mark.parametrize("strategy", [lambda: ls.MirroredStrategy(4), pytest.param(_zero3, id="zero3")])
def test_a_save_in_the_hook_that_assigned_writes_what_was_assigned_and_training_goes_on_from_it(strategy, tmp_path):
    """Before: the save lent the Keras variables the training state again, over what the hook had
    just assigned: the file held the weights before the assignment, and the assignment was lost."""
    keras_model, keras_writer = regressor(), WritesThenSaves(tmp_path / "keras")
    os.makedirs(keras_writer.directory)
    want = keras_model.fit(X, Y_VALUE, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[keras_writer])
    with strategy().scope():
        model = regressor()
    writer = WritesThenSaves(tmp_path / "lockstep")
    os.makedirs(writer.directory)
    got = model.fit(X, Y_VALUE, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[writer])
    assert_logs_close(got.history, want.history)
    for epoch in range(2):
        saved = []
        for directory in (keras_writer.directory, writer.directory):
            fresh = regressor()
            fresh.load_weights(os.path.join(directory, f"{epoch}.weights.h5"))
            saved.append(fresh.get_weights())
        np.testing.assert_allclose(saved[1][1], np.full((8,), 0.05 * (epoch + 1), np.float32))  # the bias assigned
        assert_weights_close(saved[1], saved[0])
    assert_weights_close(model.get_weights(), keras_model.get_weights())


class WithL2(keras.Sequential):
    """A model overriding `compute_loss` (JAX signature) to add an L2 penalty, as Keras users write."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * ops.sum(ops.square(self.layers[0].kernel))


class TimesTen(keras.Sequential):
    """A model overriding `predict_step` (JAX signature)."""

    def predict_step(self, state, data):
        outputs, non_trainable = super().predict_step(state, data)
        return outputs * 10, non_trainable


class OwnTrainStep(keras.Sequential):
    def train_step(self, state, data):
        return super().train_step(state, data)


class OwnTestStep(keras.Sequential):
    def test_step(self, state, data):
        return super().test_step(state, data)


class OwnMetrics(keras.Sequential):
    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, y_pred, sample_weight)


@pytest.mark.parametrize("cls, method", [(WithL2, "compute_loss"), (TimesTen, "predict_step"),
                                         (OwnTrainStep, "train_step"), (OwnTestStep, "test_step"),
                                         (OwnMetrics, "compute_metrics")])
def test_an_overridden_keras_step_is_refused_naming_it_before_any_step(cls, method):
    """Before: the override was never called and the numbers were the standard step's (compute_loss
    with an L2 term: loss 1.3886 vs Keras 2.3592; predict_step x10: 5.0 vs 50.0)."""
    with ls.MirroredStrategy(2).scope():
        keras.utils.set_random_seed(0)
        model = cls([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    for call in (lambda: model.fit(X, Y_VALUE, verbose=0), lambda: model.evaluate(X, Y_VALUE, verbose=0),
                 lambda: model.predict(X, verbose=0)):
        with pytest.raises(ValueError, match=rf"the model overrides `{cls.__name__}.{method}`: lockstep's fit / "
                                             rf"evaluate / predict run their own distributed step"):
            call()
    assert_weights_close(model.get_weights(), before)
    reference = cls([keras.Input((5,)), keras.layers.Dense(1)])  # Keras' own fit still runs it off the strategy
    reference.compile(optimizer="sgd", loss="mse")
    reference.fit(X[:8], Y_VALUE[:8], verbose=0)


class Batches(keras.utils.PyDataset):
    """A user's PyDataset of `B`-row batches of X; it records the batches read and its epoch ends.
    `order` replays a given order of batches."""

    def __init__(self, order=None):
        super().__init__()
        self.order, self.read, self.epochs_ended = order, [], 0

    def __len__(self):
        return -(-N // B)

    def __getitem__(self, i):
        self.read.append(i)
        j = i if self.order is None else self.order[i]
        return X[j * B:(j + 1) * B], Y_VALUE[j * B:(j + 1) * B]

    def on_epoch_end(self):
        self.epochs_ended += 1


@pytest.mark.parametrize("replicas", [1, 4])
def test_a_py_dataset_is_shuffled_by_batch_as_keras_shuffles_it(replicas):
    """Before: `fit(py_dataset)` ignored its default shuffle=True (Keras shuffles the order of the
    batches each epoch) and never called the dataset's on_epoch_end."""
    with ls.MirroredStrategy(replicas).scope():
        model = regressor()
    data, epochs, n = Batches(), 3, -(-N // B)
    history = model.fit(data, epochs=epochs, verbose=0).history
    orders = [data.read[-n * (epochs - e):][:n] for e in range(epochs)]
    assert all(sorted(o) == list(range(n)) for o in orders) and len({tuple(o) for o in orders}) == epochs
    assert data.epochs_ended == epochs + 1  # and once after the pass Keras' first fit builds the metrics on
    keras_model = regressor()  # Keras' own fit on the same orders of batches
    replay = Batches(order=[i for o in orders for i in o])
    want = {k: [] for k in history}
    for e in range(epochs):
        replay.order = orders[e]
        for k, v in keras_model.fit(replay, epochs=1, shuffle=False, verbose=0).history.items():
            want[k] += v
    assert_logs_close(history, want)
    assert_weights_close(model.get_weights(), keras_model.get_weights())
    unshuffled = Batches()
    model.fit(unshuffled, epochs=1, shuffle=False, verbose=0)
    assert unshuffled.read[-n:] == list(range(n))


def two_inputs():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("x, message", [
    ({"a": X[:, :3], "B": X[:, 3:]}, r'Missing data for input "b". You passed a data dictionary with keys'),
    ({"a": X[:, :3]}, r'Missing data for input "b"'),
    ([X[:, 3:], X[:, :3]], r"Input 0 with name 'a' of layer .* is incompatible with the layer: expected shape=\(None, "
                           r"3\), found shape=\(16, 2\)")])
def test_inputs_are_checked_by_name_and_structure_as_keras_checks_them_before_any_step(x, message):
    """Before: a misspelled key ("B" for "b") or a list [xb, xa] for a dict-input model trained on
    misassigned inputs."""
    with pytest.raises(ValueError, match=message):
        two_inputs().fit(x, Y_VALUE, batch_size=B, verbose=0)  # Keras' own
    with ls.MirroredStrategy(4).scope():
        model = two_inputs()
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"`x` does not fit the model's inputs: " + message):
        model.fit(x, Y_VALUE, batch_size=B, verbose=0)
    assert_weights_close(model.get_weights(), before)
    extra = {"a": X[:, :3], "b": X[:, 3:], "c": X}  # a key the model does not name is left out, as by Keras
    with pytest.warns(UserWarning, match="structure of `inputs` doesn't match"):  # Keras' warning, in both
        got = model.fit(extra, Y_VALUE, batch_size=B, shuffle=False, verbose=0).history
        want = two_inputs().fit(extra, Y_VALUE, batch_size=B, shuffle=False, verbose=0).history
    assert_logs_close(got, want)


def test_trainable_changed_without_compiling_again_is_refused_before_any_step_as_keras_does():
    """Before: `layer.trainable = False` then `fit` trained a whole epoch, then failed on an assign of
    the wrong shape, and the next fit went on from a half-applied state."""
    keras_model = regressor()
    keras_model.fit(X, Y_VALUE, batch_size=B, epochs=1, shuffle=False, verbose=0)
    with ls.MirroredStrategy(4).scope():
        model = regressor()
    model.fit(X, Y_VALUE, batch_size=B, epochs=1, shuffle=False, verbose=0)
    for m in (keras_model, model):
        m.layers[0].trainable = False
    before = model.get_weights()
    assert model.evaluate(X, Y_VALUE, batch_size=B, verbose=0) == pytest.approx(
        keras_model.evaluate(X, Y_VALUE, batch_size=B, verbose=0), rel=1e-6)  # evaluate goes on, as in Keras
    with pytest.raises(ValueError, match="must be a list of tensors corresponding 1:1"):
        keras_model.fit(X, Y_VALUE, batch_size=B, epochs=1, verbose=0)  # Keras refuses it
    with pytest.raises(ValueError, match=r"the Keras optimizer was built for 4 trainable variables and the model now "
                                         r"has 2: a layer's `trainable` changed after `compile`"):
        model.fit(X, Y_VALUE, batch_size=B, epochs=1, verbose=0)
    assert_weights_close(model.get_weights(), before)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")  # compiled again: the layer stays frozen
    model.fit(X, Y_VALUE, batch_size=B, epochs=1, shuffle=False, verbose=0)
    after = model.get_weights()
    assert_weights_close(after[:2], before[:2])
    assert not np.allclose(after[2], before[2])
    trainer = ls.Trainer(regressor(), strategy=ls.MirroredStrategy(2))  # a Trainer made before the change
    trainer.fit(X, Y_VALUE, batch_size=B, epochs=1, verbose=0)
    trainer.model.layers[1].trainable = False
    with pytest.raises(ValueError, match="the model's trainable variables changed after this Trainer was made"):
        trainer.evaluate(X, Y_VALUE, batch_size=B)


class Trained(keras.callbacks.Callback):
    """Counts the steps trained."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(y=np.stack([Y_CLASS, Y_CLASS], 1)), r"`y` has shape \(203, 2\), but the model predicts 3 classes for each "
                                               r"label of shape \(\): a sparse loss takes integer labels of shape "
                                               r"\(batch,\), or with a trailing 1"),
    (dict(validation_data=(X, np.stack([Y_CLASS, Y_CLASS], 1))), r"`validation_data` has shape \(203, 2\), but the "
                                                                  r"model predicts 3 classes"),
    (dict(validation_data=(X[:, :3], Y_CLASS)), r"`validation_data` has samples of shape \(3,\), which the model "
                                                r"cannot take: it took samples of shape \(5,\)"),
    (dict(validation_data=[(X[:16, :3], Y_CLASS[:16])]), r"`validation_data` has samples of shape \(3,\)")])
def test_labels_and_validation_data_that_do_not_fit_the_model_are_named_before_any_step(kwargs, message):
    """Before: labels (N, 2) for a sparse loss failed inside the step with 'cannot reshape array',
    and validation data of the wrong shape was named only after the first epoch had trained."""
    with ls.MirroredStrategy(2).scope():
        model = classifier()
    trained = Trained()
    with pytest.raises(ValueError, match=message):
        model.fit(X, kwargs.pop("y", Y_CLASS), batch_size=B, epochs=1, verbose=0, callbacks=[trained], **kwargs)
    assert trained.steps == 0


@pytest.mark.parametrize("name", ["adam", "adamw", "rmsprop"])
def test_an_optimizer_named_to_the_trainer_steps_as_keras_own_of_that_name(name):
    """Before: "adam" was `optax.adam`, whose epsilon is added after the bias correction (Keras adds
    it before): with small gradients the weights differed from Keras' `compile("adam")` by 1.7e-3 after two epochs."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(37, 6)).astype("float32") * 1e-3, rng.integers(0, 3, 37)  # small gradients
    runs = []
    for lockstep in (False, True):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        if lockstep:
            trainer = ls.Trainer(model, optimizer=name, loss="sparse_categorical_crossentropy_from_logits",
                                 strategy=ls.MirroredStrategy(4))
            trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            runs.append(trainer.get_weights())
        else:
            model.compile(optimizer=name, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            runs.append(model.get_weights())
    for got, want in zip(*runs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


class _EvaluatesEachEpoch(keras.callbacks.Callback):
    """A user's callback that evaluates, predicts and calls the model at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append([self.model.evaluate(X[:20], Y_VALUE[:20], batch_size=8, verbose=0),
                          np.asarray(self.model.predict(X[:5], verbose=0)).ravel().tolist(),
                          np.asarray(self.model(X[:5])).ravel().tolist()])


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_callback_evaluating_during_fit_leaves_the_next_fit_keras_own(replicas):
    """Before, the callback's `evaluate` made a new Trainer from the weights lent to the model
    (fresh Adam moments, step 0), which the next fit then continued from: its loss 0.5428 for
    Keras' 0.4804 and 5 optimizer steps for 20. Now it runs on the trainer that fits."""
    def run(model):
        callback = _EvaluatesEachEpoch()
        first = model.fit(X[:37], Y_VALUE[:37], batch_size=8, epochs=3, shuffle=False, verbose=0,
                          callbacks=[callback]).history
        second = model.fit(X[:37], Y_VALUE[:37], batch_size=8, epochs=1, shuffle=False, verbose=0).history
        return first, callback.seen, second, int(model.optimizer.iterations)
    (want, want_w), (got, got_w) = in_keras_and_lockstep(lambda: regressor(optimizer=keras.optimizers.Adam(0.05)),
                                                         run, ls.MirroredStrategy(replicas))
    assert got[3] == want[3] == 20
    assert_logs_close(got[0], want[0])
    assert_logs_close(got[2], want[2])
    np.testing.assert_allclose(got[1][-1][0], want[1][-1][0], rtol=1e-5)
    np.testing.assert_allclose(got[1][-1][1], want[1][-1][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1][-1][2], want[1][-1][2], rtol=1e-5, atol=1e-6)  # self.model(x): not callable before
    assert_weights_close(got_w, want_w, atol=1e-5)


def test_tensorboard_histograms_read_the_weights_of_each_epoch_as_in_keras(tmp_path):
    """`TensorBoard(histogram_freq=1)` reads every weight at an epoch's end, not lent them (a writer,
    on worker 0 alone); beside a user's hook that runs before each step (lent the state), it read
    arrays the step had since taken over ("Array has been deleted", once the step donated its
    state). The Keras variables lent the state are lent each step's anew: the epoch's weights, as
    in Keras' own fit."""
    class Recording(keras.callbacks.TensorBoard):
        def _log_weights(self, epoch):
            self.seen.append([np.array(w) for w in self.model.weights])
            super()._log_weights(epoch)

    def run(model, ours):
        board = Recording(str(tmp_path / ("ours" if ours else "keras")), histogram_freq=1)
        board.seen = []
        before = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: None)
        model.fit(X[:21], Y_VALUE[:21], batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[before, board])
        return board.seen
    (want, _), (got, _) = in_keras_and_lockstep(lambda: regressor(optimizer="adam"), run, ls.MirroredStrategy(3))
    assert len(got) == len(want) == 2 and not np.allclose(want[0][0], want[1][0])
    for g, w in zip(got, want):
        assert_weights_close(g, w, atol=2e-6)
