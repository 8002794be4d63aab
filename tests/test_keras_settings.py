"""Keras settings and idioms that Keras' own `fit` / `evaluate` / `predict` honour, run as written
on a lockstep strategy: each gives Keras' own one-device numbers, or the error Keras gives.

Each test builds the same model twice from one seed, compiles it alike, and runs it once with
Keras alone and once in a `MirroredStrategy(4)` scope, on 13 rows in batches of 8 (the last batch
leaves replica 3 without rows).
"""

import functools
import random
import warnings

import keras
import numpy as np
import pytest

import lockstep as ls
from keras_reference import assert_logs_close, assert_weights_close, in_keras_and_lockstep

RNG = np.random.default_rng(0)
X = RNG.normal(size=(13, 3)).astype("float32")
Y = np.arange(13) % 3


def _model(regularized=False, policy=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="relu", kernel_regularizer="l2" if regularized else None,
                                dtype=policy)(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, dtype=policy)(hidden))


def _sgd_model(**compile_kw):
    """`_model()` compiled with SGD and a sparse cross-entropy on its logits."""
    model = _model()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kw)
    return model


def _both(build, run):
    """`in_keras_and_lockstep` on 4 replicas."""
    return in_keras_and_lockstep(build, run, ls.MirroredStrategy(4))


def _fit(model, **kw):
    return model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kw).history


def test_a_model_compiled_without_a_loss_trains_on_its_add_loss_terms_alone():
    """Keras trains such a model on its layers' losses (here an L2 penalty); lockstep took its
    default loss instead."""
    def build():
        model = _model(regularized=True)
        model.compile(optimizer="sgd")
        return model
    (want, want_w), (got, got_w) = _both(build, _fit)
    assert_logs_close(got, want)
    assert_weights_close(got_w, want_w)
    assert want["loss"][0] > 0


def test_compiling_again_with_other_loss_weights_is_taken_up():
    """A second `compile` with the same optimizer object and loss name but other `loss_weights`
    (or `steps_per_execution`) changes what evaluate reports, in Keras and in lockstep alike."""
    optimizer = keras.optimizers.SGD(0.1)

    def build():
        model = _model()
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def run(model):
        first = model.evaluate(X, Y, batch_size=8, verbose=0)
        model.compile(optimizer=model.optimizer, loss=model.loss, loss_weights=[10.0])
        return [first, model.evaluate(X, Y, batch_size=8, verbose=0)]
    (want, _), (got, _) = _both(build, run)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(want[1], 10 * want[0], rtol=1e-5)


@pytest.mark.parametrize("auto_scale_loss", [True, False])
def test_mixed_float16_follows_keras_auto_scale_loss_and_reports_keras_logs(auto_scale_loss):
    """A model built under the `mixed_float16` policy: Keras' compile wraps its optimizer in a
    `LossScaleOptimizer` unless `auto_scale_loss=False`, and lockstep scales the loss exactly then
    (its own `Trainer.fit` logs `skipped_steps` when it scales); Keras' logs (History,
    `train_on_batch`) hold no count of skipped steps."""
    def build():
        keras.config.set_dtype_policy("mixed_float16")
        try:
            model = _model()
        finally:
            keras.config.set_dtype_policy("float32")
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      auto_scale_loss=auto_scale_loss)
        return model

    def run(model, in_lockstep):
        scaled = type(model.optimizer).__name__ == "LossScaleOptimizer"
        result = _fit(model), model.train_on_batch(X[:8], Y[:8]), scaled
        if in_lockstep:  # lockstep's own Trainer on the compiled model: does it scale the loss?
            logs = ls.Trainer(model).fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
            result += ("skipped_steps" in logs,)
        return result
    (want, want_w), (got, got_w) = _both(build, run)
    assert want[2] == got[2] == auto_scale_loss  # Keras' own decision, seen on the model
    assert got[3] == auto_scale_loss
    assert_logs_close(got[0], want[0], rtol=1e-3, atol=1e-4)  # float16 steps: the same to its precision
    assert np.ndim(got[1]) == np.ndim(want[1]) == 0, (got[1], want[1])


def test_class_weight_as_keras_reads_it_and_refused_beside_sample_weight():
    """Keras rounds soft labels, weighs a class `class_weight` leaves out by 1, and refuses
    `class_weight` beside `sample_weight`."""
    soft = np.where(np.arange(13) % 2, 0.9, 0.2).astype("float32")[:, None]  # labels 1 and 0

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="sgd", loss="binary_crossentropy")
        return model

    def run(model):
        history = model.fit(X, soft, batch_size=8, epochs=2, shuffle=False, verbose=0, class_weight={1: 5.0}).history
        with pytest.raises(ValueError, match=r"You cannot `class_weight` and `sample_weight` at the same time"):
            model.fit(X, soft, batch_size=8, verbose=0, class_weight={1: 5.0}, sample_weight=np.ones(13))
        return history
    (want, want_w), (got, got_w) = _both(build, run)
    assert_logs_close(got, want)
    assert_weights_close(got_w, want_w)


class _StopAt(keras.callbacks.Callback):
    """Ends evaluate (or predict) after batch `at`, as Keras' `stop_evaluating` does."""

    def __init__(self, flag, at=0):
        super().__init__()
        self.flag, self.at = flag, at

    def on_test_batch_end(self, batch, logs=None):
        if self.flag == "stop_evaluating" and batch == self.at:
            self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        if self.flag == "stop_predicting" and batch == self.at:
            self.model.stop_predicting = True


class _StopAtBegin(keras.callbacks.Callback):
    """Asks to end evaluate before its first batch: Keras runs that one batch."""

    def on_test_begin(self, logs=None):
        self.model.stop_evaluating = True


def test_a_callback_ends_evaluate_and_predict_where_keras_does():
    build = functools.partial(_sgd_model, metrics=["accuracy"])

    def run(model):
        return (model.evaluate(X, Y, batch_size=4, verbose=0, callbacks=[_StopAt("stop_evaluating", 1)]),
                model.predict(X, batch_size=4, verbose=0, callbacks=[_StopAt("stop_predicting", 1)]),
                model.evaluate(X, Y, batch_size=4, verbose=0),  # the next evaluate runs whole again
                model.evaluate(X, Y, batch_size=4, verbose=0, callbacks=[_StopAtBegin()]))
    (want, _), (got, _) = _both(build, run)
    np.testing.assert_allclose(got[3], want[3], rtol=1e-5)
    assert not np.allclose(want[3], want[0])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert got[1].shape == want[1].shape == (8, 3)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    assert not np.allclose(want[0], want[2])


def test_keras_debugging_limits_on_epochs_and_steps_are_honoured():
    build = _sgd_model

    def run(model, in_lockstep):
        keras.config.set_max_epochs(1)
        keras.config.set_max_steps_per_epoch(1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Keras' "Limiting epochs to 1", "Limiting steps_per_epoch to 1"
                history = model.fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0,
                                    validation_data=(X, Y)).history
                evaluated = model.evaluate(X, Y, batch_size=4, verbose=0)
                predicted = model.predict(X, batch_size=4, verbose=0)  # one batch, as Keras predicts
        finally:
            keras.config.set_max_epochs(None)
            keras.config.set_max_steps_per_epoch(None)
        return history, evaluated, predicted
    (want, want_w), (got, got_w) = _both(build, run)
    assert len(want[0]["loss"]) == 1 and len(want[2]) == 4
    assert_logs_close(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert_weights_close(got_w, want_w)


def test_validation_data_given_as_a_list_is_read_as_keras_reads_it():
    def build():
        model = _model()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    (want, _), (got, _) = _both(build, lambda model: _fit(model, validation_data=[X[:5], Y[:5]]))
    assert "val_loss" in want
    assert_logs_close(got, want)


@pytest.mark.parametrize("steps_per_epoch", [5, 9])
def test_steps_per_epoch_that_a_pass_does_not_fill_ends_the_epoch_with_the_pass_as_in_keras(steps_per_epoch):
    """7 batches a pass: Keras' epochs of `steps_per_epoch=5` take 5, 2, 5 steps (the second ends
    with the pass, the third starts a new one), of 9 take 7 each; lockstep went on into the next
    pass inside the epoch (5, 5, 5 and 9, 9, 9 steps)."""
    x, y = RNG.normal(size=(14, 3)).astype("float32"), np.arange(14) % 3

    build = _sgd_model

    def run(model):
        steps = []

        class Count(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                steps.append(0)

            def on_train_batch_end(self, batch, logs=None):
                steps[-1] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras': "Your input ran out of data"
            history = model.fit(x, y, batch_size=2, epochs=3, steps_per_epoch=steps_per_epoch, shuffle=False,
                                verbose=0, callbacks=[Count()]).history
        return history, steps
    (want, want_w), (got, got_w) = _both(build, run)
    assert want[1] == ([5, 2, 5] if steps_per_epoch == 5 else [7, 7, 7])
    assert got[1] == want[1]
    assert_logs_close(got[0], want[0])
    assert_weights_close(got_w, want_w)


@pytest.mark.parametrize("n", [13, 3])  # 3 rows: one batch of 3 on 4 replicas, one without rows
@pytest.mark.parametrize("how", ["epochs", "steps_per_epoch"])
def test_shuffle_batch_draws_each_batchs_permutation_from_numpys_global_state_as_keras_does(how, n):
    """Keras' `shuffle="batch"` (on JAX) keeps the batches in order and permutes the rows inside each
    with `np.random.permutation`, batch by batch (and the first batch's once more when its first fit
    builds the model). Lockstep keeps the rows in order (the same sums) and draws alike; it drew
    nothing, so every later draw (a callback's, the next shuffled fit's) differed. Other values are
    refused, naming them."""
    kw = {"epochs": dict(epochs=2), "steps_per_epoch": dict(epochs=3, steps_per_epoch=2)}[how]
    x, y = RNG.normal(size=(n, 3)).astype("float32"), np.arange(n) % 3

    def run(model, in_lockstep):
        seen = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras': "Your input ran out of data"
            history = model.fit(x, y, batch_size=4, shuffle="batch", verbose=0, callbacks=[_Draws(seen)],
                                **kw).history
            second = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history
        if in_lockstep:
            with pytest.raises(ValueError, match=r"`shuffle` must be True, False or 'batch'.*shuffle='rows'"):
                model.fit(x, y, batch_size=4, shuffle="rows", verbose=0)
        return history, second, seen, float(np.random.uniform())
    (want, want_w), (got, got_w) = _both(functools.partial(_sgd_model, metrics=["accuracy"]), run)
    assert_logs_close(got[0], want[0])
    assert_logs_close(got[1], want[1])
    assert got[2:] == want[2:]
    assert_weights_close(got_w, want_w)


def test_batches_shuffled_in_batches_draw_keras_permutations_as_fit_takes_them():
    """`lockstep.data.batches(shuffle="batch")` keeps its rows in order (a batch's sums do not depend
    on them); with `seed=None`, each batch `fit` takes draws Keras' permutation of its rows from
    NumPy's global state, and only then."""
    data = ls.data.batches(np.arange(11), batch_size=4, shuffle="batch", seed=None)

    def after(draw):
        np.random.seed(1)
        draw()
        return np.random.uniform()
    assert after(lambda: [b.tolist() for b in data]) == after(lambda: None)  # reading draws nothing
    assert [b.tolist() for b in data] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert (after(lambda: [data.taken(0, i) for i in range(len(data))])
            == after(lambda: [np.random.permutation(m) for m in (4, 4, 3)]))
    with pytest.raises(ValueError, match=r"`shuffle` must be True, False or 'batch'.*shuffle='rows'"):
        ls.data.batches(np.arange(11), batch_size=4, shuffle="rows")


def test_steps_that_are_not_whole_executions_are_rounded_up_as_keras_runs_them():
    """Keras' loops run whole calls of `steps_per_execution` batches: `steps_per_epoch=5` at 3 a
    call reads 6 batches (the second epoch the one left of a 7-batch pass), `evaluate(steps=5)` and
    `predict(steps=5)` 6; lockstep ran 5 (and refused `predict(steps=...)`). The callbacks' `params`
    say the steps as given, as Keras' do (lockstep said 6, and a pass's 7 for `steps_per_epoch=9`)."""
    x, y = RNG.normal(size=(14, 3)).astype("float32"), np.arange(14) % 3

    build = functools.partial(_sgd_model, steps_per_execution=3)

    def run(model):
        params = _Params()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras': "Your input ran out of data"
            history = model.fit(x, y, batch_size=2, epochs=3, steps_per_epoch=5, shuffle=False, verbose=0,
                                validation_data=(x, y), validation_steps=2, callbacks=[params]).history
            evaluated = model.evaluate(x, y, batch_size=2, steps=5, verbose=0, callbacks=[params])
            predicted = model.predict(x, batch_size=2, steps=5, verbose=0, callbacks=[params])
            steps = [int(model.optimizer.iterations)]
            model.fit(x, y, batch_size=2, steps_per_epoch=9, shuffle=False, verbose=0, callbacks=[params])
        return history, evaluated, steps + [int(model.optimizer.iterations)], predicted, params.seen
    (want, want_w), (got, got_w) = _both(build, run)
    assert want[2] == [6 + 1 + 6, 6 + 1 + 6 + 7] and len(want[3]) == 12
    assert got[2] == want[2]
    np.testing.assert_allclose(got[3], want[3], rtol=1e-5, atol=1e-6)
    assert_logs_close(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    assert_weights_close(got_w, want_w)
    assert want[4] == [("fit", 5)] + [("evaluate", 5)] * 4 + [("predict", 5), ("fit", 9)]  # 3 validations
    assert got[4] == want[4]


class _Params(keras.callbacks.Callback):
    """Records the `params["steps"]` each loop gives its callbacks."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_begin(self, logs=None):
        self.seen.append(("fit", self.params["steps"]))

    def on_test_begin(self, logs=None):
        self.seen.append(("evaluate", self.params["steps"]))

    def on_predict_begin(self, logs=None):
        self.seen.append(("predict", self.params["steps"]))


def test_callbacks_of_evaluate_and_predict_are_given_keras_params():
    """Keras gives every loop's callbacks `params` (verbose, epochs, steps); lockstep gave those of
    evaluate and predict none."""
    build = _sgd_model

    def run(model):
        seen = []

        class Params(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                seen.append(("fit", dict(self.params)))

            def on_test_begin(self, logs=None):
                seen.append(("evaluate", dict(self.params)))

            def on_predict_begin(self, logs=None):
                seen.append(("predict", dict(self.params)))
        _fit(model, callbacks=[Params()])
        model.evaluate(X, Y, batch_size=4, verbose=0, callbacks=[Params()])
        model.evaluate(X, Y, batch_size=4, steps=2, callbacks=[Params()])  # verbose "auto", as Keras passes it on
        model.predict(X, batch_size=5, verbose=0, callbacks=[Params()])
        return seen
    (want, _), (got, _) = _both(build, run)
    assert want[1] == ("evaluate", {"verbose": 0, "epochs": 1, "steps": 4})
    assert got == want


def test_monitors_in_auto_mode_and_get_metrics_result_read_keras_compiled_metrics():
    """`EarlyStopping(monitor="val_accuracy")` (mode "auto") finds the metric's direction in Keras'
    compiled metrics, which lockstep left unbuilt (a ValueError); `get_metrics_result()` is the last
    loop's, as Keras' (it raised "not built")."""
    build = functools.partial(_sgd_model, metrics=["accuracy"])

    def run(model):
        callbacks = [keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=1),
                     keras.callbacks.ReduceLROnPlateau(monitor="accuracy", patience=1, factor=0.5)]
        history = _fit(model, callbacks=callbacks, validation_data=(X[:6], Y[:6]))
        after_fit = model.get_metrics_result()
        model.evaluate(X, Y, batch_size=8, verbose=0)
        return history, after_fit, model.get_metrics_result()
    (want, want_w), (got, got_w) = _both(build, run)
    assert_logs_close(got[0], want[0])
    assert_weights_close(got_w, want_w)
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == list(w)
        np.testing.assert_allclose([float(v) for v in g.values()], [float(v) for v in w.values()], rtol=1e-5)


def test_monitors_in_auto_mode_find_a_metric_lockstep_builds_without_the_datas_shapes(tmp_path):
    """`EarlyStopping` / `ModelCheckpoint(save_best_only=True)` on "val_mae" (mode "auto"): lockstep
    builds "mae" before any batch, and so left Keras' compiled metrics unbuilt, where the callbacks
    look for its direction (the ValueError "Keras isn't able to automatically determine")."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(13, 3)).astype(np.float32), rng.normal(size=(13, 1)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
        return model

    def run(model, in_lockstep):
        best = str(tmp_path / f"best{int(in_lockstep)}.weights.h5")
        callbacks = [keras.callbacks.EarlyStopping(monitor="val_mae", patience=1),
                     keras.callbacks.ModelCheckpoint(best, monitor="val_mae", save_best_only=True,
                                                     save_weights_only=True)]
        history = model.fit(x, y, batch_size=8, epochs=6, shuffle=False, verbose=0, validation_split=0.25,
                            callbacks=callbacks).history
        model.load_weights(best)
        return history
    (want, want_w), (got, got_w) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(4))
    assert_logs_close(got, want)
    assert_weights_close(got_w, want_w)


def test_model_history_history_model_stop_training_and_logs_as_keras_sets_them():
    """`model.history` is the running fit's History from its start (lockstep set it at the end),
    `history.model` the Keras model (it was the Trainer), `model.stop_training` stays True after a
    callback stopped the fit; hooks without logs get `{}` and batch logs take new entries."""
    build = _sgd_model

    def run(model):
        seen = []

        class Reads(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                seen.append((epoch, logs.get("loss"), dict(self.model.history.history)))

            def on_train_batch_end(self, batch, logs=None):
                logs["twice"] = 2 * logs["loss"]
                seen.append(sorted(logs.copy()))
                if batch == 1:
                    self.model.stop_training = True
        history = model.fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[Reads()])
        return (seen, model.history is history, model.stop_training, history.model is model,
                history.model.evaluate(X, Y, batch_size=8, verbose=0))
    (want, _), (got, _) = _both(build, run)
    assert want[0][0] == (0, None, {}) and want[1:4] == (True, True, True)
    assert got[0] == want[0] and got[1:4] == want[1:4]
    np.testing.assert_allclose(got[4], want[4], rtol=1e-5)


def test_a_generator_as_validation_data_read_by_several_epochs_is_refused():
    """Keras keeps a one-shot generator's first 2 batches and reads them again at each later
    validation before what is left of it; lockstep read on: refused, naming the argument. Read by
    one validation, it gives Keras' numbers."""
    build = _sgd_model

    def batches():
        return ((X[i:i + 4], Y[i:i + 4]) for i in range(0, 13, 4))

    def run(model, in_lockstep):
        if in_lockstep:
            with pytest.raises(ValueError, match=r"`validation_data` is a one-shot .* and 2 epochs validate"):
                _fit(model, validation_data=batches())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras': "Your input ran out of data" (its generator's end)
            return model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=batches(),
                             validation_freq=2).history
    (want, _), (got, _) = _both(build, run)
    assert "val_loss" in want
    assert_logs_close(got, want)


def test_logs_history_and_returned_dicts_name_their_entries_in_keras_order():
    """Keras sorts the logs' names (`accuracy` before `loss`) in every hook, the History and the
    dicts `evaluate` / `train_on_batch` return; lockstep put the loss first. Values were equal."""
    build = functools.partial(_sgd_model, metrics=["accuracy"])

    def run(model):
        keys = []

        class Keys(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                keys.append(("batch", list(logs)))

            def on_test_end(self, logs=None):
                keys.append(("test", list(logs)))

            def on_epoch_end(self, epoch, logs=None):
                keys.append(("epoch", list(logs)))
        history = _fit(model, callbacks=[Keys()], validation_data=(X, Y))
        return (keys, list(history), list(model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True)),
                list(model.train_on_batch(X[:8], Y[:8], return_dict=True)), model.evaluate(X, Y, verbose=0))
    (want, _), (got, _) = _both(build, run)
    assert want[1] == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert got[:4] == want[:4]
    np.testing.assert_allclose(got[4], want[4], rtol=1e-5)  # the list form: the loss first, as Keras'


def test_a_lambda_callback_runs_its_hooks_as_in_keras():
    """`keras.callbacks.LambdaCallback` keeps its hooks on the instance: lockstep, which looked for
    them on the class, never called them."""
    def run(model):
        seen = []
        callback = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: seen.append(("epoch", epoch, round(logs["loss"], 5))),
            on_train_batch_end=lambda batch, logs: seen.append(("batch", batch, round(logs["loss"], 5))),
            on_batch_begin=lambda batch, logs: seen.append(("begin", batch)))
        _fit(model, callbacks=[callback])
        return seen
    (want, _), (got, _) = _both(_sgd_model, run)
    assert len(want) == 2 * (2 + 2 + 1)
    assert got == want


class _Hooks(keras.callbacks.Callback):
    """Records every batch hook Keras calls: its name, batch number, and what its logs hold (the
    outputs' shape for predict)."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def _note(self, hook, batch, logs):
        logs = logs or {}
        shown = ({"outputs": np.shape(logs["outputs"])} if "outputs" in logs
                 else {k: round(float(v), 4) for k, v in logs.items()})
        self.seen.append((hook, batch, shown))


for _hook in ("on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end",
              "on_predict_batch_begin", "on_predict_batch_end"):
    setattr(_Hooks, _hook, functools.partialmethod(lambda self, batch, logs=None, h=_hook: self._note(h, batch, logs)))


def test_batch_hooks_under_steps_per_execution_are_called_once_a_call_numbered_as_keras_numbers_them():
    """Keras calls the batch hooks of fit, evaluate (and fit's validation) and predict once per call
    of `steps_per_execution` batches: begin with the call's first batch number, end with that plus
    `steps_per_execution` - 1, the epoch's last, shorter call included (so 8 for a 7-batch pass at 3
    a call), and predict's end with the call's outputs. Lockstep called evaluate's and predict's once
    a batch, and gave the last call's true number."""
    x, y = RNG.normal(size=(13, 3)).astype("float32"), np.arange(13) % 3
    build = functools.partial(_sgd_model, steps_per_execution=3, metrics=["accuracy"])

    def run(model):
        seen = []
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, validation_data=(x, y),
                  callbacks=[_Hooks(seen)])
        model.evaluate(x, y, batch_size=2, verbose=0, callbacks=[_Hooks(seen)])
        model.predict(x, batch_size=2, verbose=0, callbacks=[_Hooks(seen)])
        return seen
    (want, _), (got, _) = _both(build, run)
    ends = [b for h, b, _ in want if h.endswith("batch_end")]
    assert ends == [2, 5, 8] * 4, want
    assert ("on_predict_batch_end", 8, {"outputs": (1, 3)}) in want
    assert [(h, b) for h, b, _ in got] == [(h, b) for h, b, _ in want]
    for (_, _, g), (_, _, w) in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-3, atol=1e-4)


def test_get_metrics_result_after_compiling_again_is_keras_fresh_metrics_not_the_last_fit():
    """After another `compile`, Keras' `get_metrics_result()` reads the new, unbuilt metrics (Keras
    raises) until a loop runs; lockstep returned the previous compile's last results."""
    def run(model):
        _fit(model)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        with pytest.raises(ValueError) as raised:
            model.get_metrics_result()
        model.evaluate(X, Y, batch_size=8, verbose=0)
        return str(raised.value), model.get_metrics_result()
    (want, _), (got, _) = _both(functools.partial(_sgd_model, metrics=["accuracy"]), run)
    assert got[0] == want[0]
    assert list(got[1]) == list(want[1])
    np.testing.assert_allclose([float(v) for v in got[1].values()], [float(v) for v in want[1].values()], rtol=1e-5)


class _Draws(keras.callbacks.Callback):
    """Draws from NumPy's global random state at each epoch's end, as a user's callback may."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(float(np.random.uniform()))


@pytest.mark.parametrize("n", [37, 3])  # 3 rows: one short batch, a replica of the 4 without rows
@pytest.mark.parametrize("how", ["epochs", "validation_split", "steps_per_epoch"])
def test_shuffled_epochs_are_drawn_from_numpys_global_state_as_keras_draws_them(how, n):
    """Keras' fit draws each pass's order with `np.random.permutation` as the pass begins (and one
    more, left unused, when its first fit builds the compiled metrics), so a script seeded with
    `keras.utils.set_random_seed` trains on Keras' order; lockstep drew its own from (seed, pass).
    Two fits in a row, a callback drawing from NumPy at each epoch's end, and NumPy's state after."""
    kw = {"epochs": dict(epochs=3), "validation_split": dict(epochs=2, validation_split=0.3),
          "steps_per_epoch": dict(epochs=3, steps_per_epoch=3)}[how]
    x, y = RNG.normal(size=(n, 3)).astype("float32"), np.arange(n) % 3

    def run(model):
        seen = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras': "Your input ran out of data"
            first = model.fit(x, y, batch_size=8, verbose=0, callbacks=[_Draws(seen)], **kw).history
            second = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
        return first, second, seen, float(np.random.uniform())
    (want, want_w), (got, got_w) = _both(functools.partial(_sgd_model, metrics=["accuracy"]), run)
    assert_logs_close(got[0], want[0])
    assert_logs_close(got[1], want[1])
    assert got[2:] == want[2:]
    assert_weights_close(got_w, want_w)

    def unshuffled(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model.fit(x, y, batch_size=8, shuffle=False, verbose=0, **kw).history
    (plain, _), _ = _both(functools.partial(_sgd_model, metrics=["accuracy"]), unshuffled)
    if n > 8:  # several batches: the order matters to the numbers (one batch: only NumPy's state after)
        assert not np.allclose(plain["loss"], want[0]["loss"])


class _InterruptAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt


class _Plain(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // 8)

    def __getitem__(self, i):
        return self.x[i * 8:(i + 1) * 8], self.y[i * 8:(i + 1) * 8]


@pytest.mark.parametrize("data", ["arrays", "shuffled_in_batches", "py_dataset"])
@pytest.mark.parametrize("at", [(1, 2), (0, 4)])
def test_a_fit_resumed_from_a_backup_shuffles_on_as_keras_uninterrupted_fit(at, data, tmp_path):
    """A backup of a fit whose passes are drawn from NumPy's (arrays) or Python's (a PyDataset's
    batches) global random state holds where that state stood before the pass in progress was drawn
    and at the backup: the fit of a restarted script (which seeds them again) draws that pass again
    and goes on as Keras' own uninterrupted fit."""
    x, y = RNG.normal(size=(37, 3)).astype("float32"), np.arange(37) % 3
    given = {"arrays": lambda: dict(x=x, y=y, batch_size=8),
             "shuffled_in_batches": lambda: dict(x=x, y=y, batch_size=8, shuffle="batch"),
             "py_dataset": lambda: dict(x=_Plain(x, y))}[data]
    build = functools.partial(_sgd_model, metrics=["accuracy"])
    keras_model = build()
    want = keras_model.fit(**given(), epochs=3, verbose=0).history
    want_after = float(np.random.uniform()), random.random()
    strategy = ls.MirroredStrategy(4)
    with strategy.scope():
        model = build()
    with pytest.raises(KeyboardInterrupt):
        model.fit(**given(), epochs=3, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=1), _InterruptAt(*at)])
    with strategy.scope():
        resumed = build()  # the restarted script seeds the global random states again
    history = resumed.fit(**given(), epochs=3, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=1)])
    assert_logs_close(history.history, want)
    assert_weights_close([np.asarray(w) for w in resumed.get_weights()], keras_model.get_weights())
    assert (float(np.random.uniform()), random.random()) == want_after


class _Reshuffled(keras.utils.PyDataset):
    """A user's PyDataset that reshuffles its rows itself at each epoch's end (NumPy's global
    state), recording the batches read and its hooks."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.rows, self.seen = x, y, np.arange(len(x)), []

    def __len__(self):
        return -(-len(self.x) // 4)

    def __getitem__(self, i):
        self.seen.append(i)
        rows = self.rows[i * 4:(i + 1) * 4]
        return self.x[rows], self.y[rows]

    def on_epoch_begin(self):
        self.seen.append("begin")

    def on_epoch_end(self):
        self.seen.append("end")
        np.random.shuffle(self.rows)


def test_a_py_dataset_is_read_shuffled_and_reshuffles_itself_as_in_keras_fit():
    """Keras' first fit reads a PyDataset's first batch between its on_epoch_begin and on_epoch_end
    (building the compiled metrics) before epoch 0, so one that reshuffles itself there trains
    epoch 0 reshuffled; each epoch shuffles the batches with Python's `random.shuffle`. Lockstep
    read epoch 0 unshuffled and drew the batches' order from its own (seed, pass)."""
    x, y = RNG.normal(size=(21, 3)).astype("float32"), np.arange(21) % 3

    def run(model):
        data, val = _Reshuffled(x, y), _Reshuffled(x[:9], y[:9])
        first = model.fit(data, epochs=3, verbose=0, validation_data=val).history
        second = model.fit(data, epochs=2, verbose=0).history  # built: Keras ends the pass once more first
        evaluated = model.evaluate(val, verbose=0)
        hooks = [[s for s in d.seen if isinstance(s, str)] for d in (data, val)]
        return (first, second), evaluated, hooks, [len(d.seen) for d in (data, val)]
    (want, want_w), (got, got_w) = _both(functools.partial(_sgd_model, metrics=["accuracy"]), run)
    assert want[2][0][:2] == ["begin", "end"] and want[2][1][:2] == ["end", "begin"]
    assert got[2:] == want[2:]
    for g, w in zip(got[0], want[0]):
        assert_logs_close(g, w)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    assert_weights_close(got_w, want_w)


def test_a_py_dataset_after_step_memory_is_read_as_after_any_first_use():
    """`step_memory(x, y, batch_size)` compiles fit's step without placing the state; a fit on a
    PyDataset after it places the state and reads each batch as it passes (no first batch read
    ahead), as after an `evaluate` that made the state."""
    x, y = RNG.normal(size=(21, 3)).astype("float32"), np.arange(21) % 3
    seen = {}
    for first_use in ("step_memory", "evaluate"):
        with ls.MirroredStrategy(4).scope():
            model = _sgd_model(metrics=["accuracy"])
        trainer = ls.Trainer(model)
        getattr(trainer, first_use)(X, Y, batch_size=4)
        data = _Reshuffled(x, y)
        trainer.fit(data, epochs=2, verbose=0)
        seen[first_use] = data.seen
    assert seen["step_memory"] == seen["evaluate"]
    assert seen["evaluate"][0] == "begin"  # no batch read before the first pass begins


def test_predict_on_a_py_dataset_after_a_fit_refused_before_its_first_step():
    """A fit refused before its first step (labels of another shape) builds no metric and trains
    nothing; `predict` on a PyDataset then predicts Keras' outputs (lockstep failed: the refused fit
    had made the state, not the compiled steps, and predict read no first batch to make them), and
    the next fit reports what Keras' fit reports with the right labels from the start (Keras' own
    keeps "accuracy" resolved for the refused labels: not followed)."""
    def run(model, lockstep):
        if lockstep:
            with pytest.raises(ValueError, match="but the model predicts 3 classes"):
                model.fit(X, np.stack([Y, Y], 1), batch_size=8, verbose=0)
        predicted = model.predict(_Plain(X, Y), verbose=0)
        return predicted, model.fit(X, Y, batch_size=8, shuffle=False, verbose=0).history
    (want, want_w), (got, got_w) = _both(functools.partial(_sgd_model, metrics=["accuracy"]), run)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert_logs_close(got[1], want[1])
    assert_weights_close(got_w, want_w)


class _MarkBatches(keras.callbacks.Callback):
    """Notes each training call's end among a dataset's records."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("trained", batch))


@pytest.mark.parametrize("steps_per_execution", [1, 3, 4])  # 4: a pass of 6 batches ends with a short call
def test_a_py_dataset_read_in_part_is_begun_and_ended_each_loop_epoch_as_in_keras(steps_per_execution):
    """Keras calls a PyDataset's `on_epoch_begin` / `on_epoch_end` around each epoch of its loops,
    not each pass: an epoch of `steps_per_epoch` ends (and the next begins) in the middle of a pass,
    and `validation_steps`, `evaluate(steps=)` and `predict(steps=)` end the dataset after the
    batches they read. Lockstep called them around each pass: a dataset that reshuffles itself at
    `on_epoch_end` was read in another order."""
    x, y = RNG.normal(size=(21, 3)).astype("float32"), np.arange(21) % 3

    def run(model):
        data, val = _Reshuffled(x, y), _Reshuffled(x[:9], y[:9])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras': "Your input ran out of data"
            history = model.fit(data, epochs=3, steps_per_epoch=4, verbose=0, validation_data=val,
                                validation_steps=2, callbacks=[_MarkBatches(data.seen)]).history
        evaluated = model.evaluate(val, steps=2, verbose=0)
        predicted = model.predict(val, steps=1, verbose=0)
        return history, evaluated, predicted, [d.seen for d in (data, val)]
    build = functools.partial(_sgd_model, metrics=["accuracy"], steps_per_execution=steps_per_execution)
    (want, want_w), (got, got_w) = _both(build, run)
    assert got[3] == want[3]
    assert_logs_close(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert_weights_close(got_w, want_w)


class _BatchMeanPenalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


class _BatchSumPenalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(x)))
        return x


class _KernelPenalty(keras.layers.Dense):
    def __init__(self):
        super().__init__(4)

    def call(self, x):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(self.kernel)))
        return super().call(x)


class _BatchVariancePenalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.var(x, axis=0)))
        return x


class _MeanAfterDropout(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, x, training=False):
        x = self.dropout(x, training=training)
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


class _SumOfItsOwn(keras.Model):
    """A subclassed model adding a batch sum itself."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(4), keras.layers.Dense(3)

    def call(self, x):
        h = self.hidden(x)
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(h)))
        return self.out(h)


def _penalised(layer):
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), layer(), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    return build


def test_a_layers_add_loss_from_the_batch_is_refused_or_warned_about_unless_one_device_would_compute_it():
    """A layer's `add_loss` term computed from the batch is computed by each replica on its own rows:
    the step takes their mean, which is one device's for a mean over the rows on batches every
    replica fills, and not otherwise (here a sum: 1.507 against Keras' 1.658). A sum is refused, a
    mean warned about (and equal on 16 rows in batches of 8 on 4 replicas); a term from the weights
    alone is exact on any batch."""
    with pytest.raises(ValueError, match=r"layer '_+batch_sum_penalty.*' adds a loss computed from the batch .* not a "
                                         r"mean over the batch's rows: on 4 replicas"):
        _both(_penalised(_BatchSumPenalty), _fit)
    x, y = RNG.normal(size=(16, 3)).astype("float32"), np.arange(16) % 3

    def run(model):
        return model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    with pytest.warns(UserWarning, match=r"a mean over its rows\): on 4 replicas it is one device's only on batches "
                                         r"every replica fills"):
        (want, want_w), (got, got_w) = _both(_penalised(_BatchMeanPenalty), run)
    assert_logs_close(got, want)
    assert_weights_close(got_w, want_w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        (want, want_w), (got, got_w) = _both(_penalised(_KernelPenalty), _fit)  # 13 rows: a short batch
    assert_logs_close(got, want)
    assert_weights_close(got_w, want_w)


def test_the_add_loss_probe_tells_a_mean_from_other_forms_and_leaves_predict_alone():
    """A variance over the batch (0 on any one row) and a subclassed model's own batch sum are
    refused; a mean after a Dropout is a mean (each probe's rows draw alike), warned about; a
    refused model still predicts (its losses are not used). The variance is refused also where the
    batch's first two rows are alike (before, the probe compared them, saw one value, and let the
    term through as not computed from the batch)."""
    strategy = ls.MirroredStrategy(4)
    for build in (_penalised(_BatchVariancePenalty), lambda: _SumOfItsOwn()):
        with strategy.scope():
            model = build()
            model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        assert model.predict(X, batch_size=8, verbose=0).shape == (13, 3)
        with pytest.raises(ValueError, match=r"adds a loss computed from the batch .* not a mean"):
            model.fit(X, Y, batch_size=8, verbose=0)
    with strategy.scope():
        model = _penalised(_MeanAfterDropout)()
    with pytest.warns(UserWarning, match=r"a mean over its rows\): on 4 replicas"):
        model.fit(X, Y, batch_size=8, verbose=0)
    twice = np.concatenate([X[:1], X])  # the first two rows alike: each a variance of 0, as are both
    with strategy.scope():
        model = _penalised(_BatchVariancePenalty)()
    with pytest.raises(ValueError, match=r"adds a loss computed from the batch .* not a mean"):
        model.fit(twice, np.concatenate([Y[:1], Y]), batch_size=8, verbose=0)


class _Subclassed(keras.Model):
    """TF's `MyModel(keras.Model)` idiom: its variables are made when it is first called."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)

    def call(self, x):  # no `training` argument
        return self.out(self.hidden(x))


class _SquaredError(keras.losses.Loss):
    """A user's loss class: Keras' by its base."""

    def call(self, y_true, y_pred):
        target = keras.ops.one_hot(keras.ops.cast(y_true, "int32"), 3)
        return keras.ops.mean(keras.ops.square(y_pred - target), axis=-1)


@pytest.mark.parametrize("loss", ["logits", "own_loss_class"])
def test_a_subclassed_model_made_in_the_scope_trains_on_it_with_its_compile_as_keras_does(loss):
    """A subclassed model made in the scope makes its variables in its first `evaluate` / `fit`,
    after the block: it trained with Keras' own loop, on one device, outside the strategy (each
    worker alone in a job); lockstep then took neither its compiled loss (a subclass of Keras' is
    Keras') nor a `call` without `training`. Now it trains on the strategy, equal to Keras' fit."""
    given = {"logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
             "own_loss_class": _SquaredError()}[loss]

    def build():
        keras.utils.set_random_seed(0)
        model = _Subclassed()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=given, metrics=["accuracy"])
        return model

    def run(model, in_lockstep):
        before = model.evaluate(X, Y, batch_size=8, verbose=0)
        history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0).history
        if in_lockstep:  # run by lockstep's Trainer on the scope's strategy, not by Keras' own loop
            assert model.__dict__["_lockstep_trainer"][1].strategy.num_replicas_in_sync == 4
        return before, history, model.predict(X, batch_size=8, verbose=0)
    (want, want_w), (got, got_w) = _both(build, run)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_logs_close(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert_weights_close(got_w, want_w)


def _batches_of(x, y=None, size=8):
    """A generator of `x`'s (and `y`'s) batches, tuples as Keras wants them: a one-shot iterable."""
    for i in range(0, len(x), size):
        yield (x[i:i + size],) if y is None else (x[i:i + size], y[i:i + size])


def subclassed_compiled():
    """`_Subclassed`, seeded and compiled as the generator tests train it (also on two workers,
    `tests/workers/keras_custom_metrics_job.py`)."""
    keras.utils.set_random_seed(0)
    model = _Subclassed()
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def on_a_generator(model, call):
    """`model`'s `call` ("fit": one epoch, "evaluate", "predict") on a generator of X's (and Y's)
    batches of 8: the History's dict, the logs or the outputs."""
    if call == "fit":
        return model.fit(_batches_of(X, Y), epochs=1, shuffle=False, verbose=0).history
    if call == "evaluate":
        return model.evaluate(_batches_of(X, Y), verbose=0, return_dict=True)
    return model.predict(_batches_of(X), verbose=0)


@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # Keras' own, at a generator's end
@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_a_subclassed_model_made_in_the_scope_is_built_on_a_generators_first_batch_as_keras_does(call):
    """A subclassed model made and compiled in the scope, first used on a generator (13 rows in
    batches of 8 on 4 replicas): its first batch builds it, as Keras' loop builds it, and is then
    trained on (or evaluated, predicted) all the same. Before, the Trainer was made first and
    refused the Keras optimizer of a model without variables."""
    (want, want_w), (got, got_w) = _both(subclassed_compiled, lambda model: on_a_generator(model, call))
    if call == "predict":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert_logs_close(got, want)
    assert_weights_close(got_w, want_w)


def test_a_callback_reads_a_schedules_learning_rate_and_cannot_set_it_as_in_keras():
    """A Keras optimizer made with a `LearningRateSchedule`: a callback reading
    `model.optimizer.learning_rate` got lockstep's ValueError ("does not expose its learning rate"),
    where Keras gives the schedule's value at the step; setting it now raises Keras' TypeError."""
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=3, decay_rate=0.5)
        model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
        return model

    class Reads(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append([float(np.asarray(self.model.optimizer.learning_rate)), int(self.model.optimizer.iterations)])

    def run(model):
        reads = Reads()
        history = model.fit(X, Y.astype(np.float32), batch_size=4, epochs=2, shuffle=False, verbose=0,
                            callbacks=[reads]).history
        with pytest.raises(TypeError, match="hence its learning rate is not settable"):
            model.fit(X, Y.astype(np.float32), batch_size=4, epochs=1, shuffle=False, verbose=0,
                      callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)])
        return history, reads.seen
    (want, want_w), (got, got_w) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(4))
    assert len(want[1]) == 8 and want[1][0][0] != want[1][-1][0]
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    assert_logs_close(got[0], want[0])
    assert_weights_close(got_w, want_w)


@pytest.mark.parametrize("replicas", [1, 3])
def test_sample_weights_of_shape_n_by_1_weigh_each_row_as_keras_does(replicas):
    """`sample_weight` of shape (N, 1) against per-sample losses of shape (N,): lockstep broadcast them
    into an (N, N) grid (each row's weight times the batch's mean loss), loss 1.3164 for Keras'
    1.2234 even on one replica; Keras squeezes the trailing 1. By name and as a loss object."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(37, 4)).astype(np.float32), rng.integers(0, 3, 37)
    w = rng.uniform(0.1, 2.0, size=(37, 1)).astype(np.float32)
    for loss in ("sparse_categorical_crossentropy", keras.losses.SparseCategoricalCrossentropy()):
        def build():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
            return model

        def run(model):
            evaluated = model.evaluate(x, y, sample_weight=w, batch_size=7, verbose=0)
            history = model.fit(x, y, sample_weight=w, batch_size=7, epochs=2, shuffle=False, verbose=0,
                                validation_data=(x[:9], y[:9], w[:9])).history
            return evaluated, history
        (want, want_w), (got, got_w) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(replicas))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        assert_logs_close(got[1], want[1])
        assert_weights_close(got_w, want_w)


def test_y_as_a_one_element_list_and_a_subclassed_model_with_dropout_train_as_in_keras():
    """`fit(x, [y])` for a model of one output (Keras takes its element): lockstep read the list as
    one (1, N) array (a wrong label error, or JAX's TracerArrayConversionError); so did
    `validation_data=(x, [y])`, `train_on_batch` and `test_on_batch`. A subclassed model
    whose Dropout made its seed state in `__init__`: lockstep took it for built and refused its Keras
    optimizer ("needs a Keras model with its variables")."""
    class WithDropout(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden, self.drop, self.out = (keras.layers.Dense(8), keras.layers.Dropout(0.3, seed=1),
                                                keras.layers.Dense(3))

        def call(self, inputs, training=None):
            return self.out(self.drop(self.hidden(inputs), training=training))

    def build():
        keras.utils.set_random_seed(0)
        model = WithDropout()
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    def run(model):
        history = model.fit(X, [Y], batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(X, [Y])).history
        on_batch = [model.train_on_batch(X[:8], [Y[:8]], return_dict=True),
                    model.test_on_batch(X[8:16], (Y[8:16],), return_dict=True)]
        return history, model.evaluate(X, (Y,), batch_size=8, verbose=0, return_dict=True), on_batch
    (want, want_w), (got, got_w) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(4))
    assert_logs_close(got[0], want[0])
    assert_logs_close(got[1], want[1])
    for g, w in zip(got[2], want[2]):
        assert_logs_close(g, w)
    assert_weights_close(got_w, want_w)
