"""Keras models with several inputs and outputs, compiled as Keras' guides write them — a loss per
output, `loss_weights`, metrics and weighted metrics per output, labels and sample weights per
output — trained with `model.fit` in a lockstep scope and held to Keras' own one-device `fit`
(same seed, `shuffle=False`): every log under Keras' name, `evaluate` in Keras' order, `predict`'s
structure, the weights. Before: a loss per output was refused, dict `y` failed with "`y` has a
scalar" and a list `y` with "setting an array element with a sequence"."""


import keras
import numpy as np
import keras_reference
import pytest

import lockstep as ls
from launching import WORKERS, launch_workers, output_of, rank_results

N, B = 61, 8  # 8 batches, the last of 5 rows (on 4 replicas 2, 1, 1, 1); N=58: the last of 2 (two replicas empty)
_rng = np.random.default_rng(3)
XA = _rng.normal(size=(N, 3)).astype(np.float32)
XB = _rng.normal(size=(N, 2)).astype(np.float32)
Y_CLS = ((XA[:, 0] + XB[:, 1] > 0).astype(np.int32) + (XA[:, 2] > 0.6)).astype(np.int32)
Y_REG = (XA @ np.array([1.0, -2.0, 0.5]) + XB[:, :1].sum(-1) + 1.0).astype(np.float32)[:, None]
W = _rng.uniform(0.2, 2.0, size=N).astype(np.float32)
W_CLS = _rng.uniform(0.5, 1.5, size=N).astype(np.float32)


def two_headed(dict_io=False, compile_kw=None):
    """Two inputs (`a`, `b`), two outputs: `cls` (3 classes) and `reg` (a value)."""
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    model = keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg}) if dict_io else keras.Model([a, b], [cls, reg])
    model.compile(**(compile_kw or dict(
        optimizer=keras.optimizers.Adam(0.02),
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.25},
        metrics={"cls": ["accuracy"], "reg": ["mae"]}, weighted_metrics={"reg": [keras.metrics.MeanSquaredError()]})))
    return model


def assert_logs_close(got, want):
    keras_reference.assert_logs_close(got, want, rtol=2e-5)  # this file's tolerance


def assert_weights_close(a, b):
    keras_reference.assert_weights_close(a, b, atol=1e-5)


FULL = pytest.mark.full_suite  # make test: 3 replicas and 4 with two empty ones; make test-full: all


@pytest.mark.parametrize("replicas, n", [pytest.param(1, N, marks=FULL), pytest.param(3, N, marks=FULL),
                                         pytest.param(4, N, marks=FULL), (4, 58)])
def test_two_inputs_two_outputs_with_a_loss_per_output_equal_keras_own(replicas, n):
    x, y = [XA[:n], XB[:n]], [Y_CLS[:n], Y_REG[:n]]
    kw = dict(batch_size=B, epochs=3, shuffle=False, verbose=0, sample_weight=W[:n],
              validation_data=([XA[:20], XB[:20]], [Y_CLS[:20], Y_REG[:20]]))
    keras_model = two_headed()
    want = keras_model.fit(x, y, **kw)
    with ls.MirroredStrategy(replicas).scope():
        model = two_headed()
    got = model.fit(x, {"cls": y[0], "reg": y[1]}, **kw)  # labels keyed by output name, as Keras also takes them
    assert isinstance(got, ls.callbacks.History)  # run by lockstep
    assert_logs_close(got.history, want.history)
    assert {"loss", "cls_loss", "reg_loss", "cls_accuracy", "reg_mae", "reg_mean_squared_error",
            "val_reg_loss"} <= set(got.history)
    assert_weights_close(model.get_weights(), keras_model.get_weights())
    # evaluate: Keras' order (the loss, each output's loss, then the metrics), and as a dict
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=B, verbose=0),
                               keras_model.evaluate(x, y, batch_size=B, verbose=0), rtol=2e-5)
    assert_logs_close(model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True, sample_weight=W[:n]),
                      keras_model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True, sample_weight=W[:n]))
    got_pred, want_pred = model.predict(x, batch_size=B, verbose=0), keras_model.predict(x, batch_size=B, verbose=0)
    assert isinstance(got_pred, list) and len(got_pred) == 2
    for g, w in zip(got_pred, want_pred):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=FULL), 4])
def test_dict_inputs_and_outputs_with_sample_weights_per_output_and_a_callback_on_one_output(replicas):
    x, y = {"a": XA, "b": XB}, {"cls": Y_CLS, "reg": Y_REG}
    def compile_kw():  # a fresh optimizer for each model
        return dict(optimizer=keras.optimizers.Adam(0.05), loss=["sparse_categorical_crossentropy", "mse"],
                    loss_weights=[0.5, 1.0], metrics={"cls": "accuracy"})

    def fit(model):
        stop = keras.callbacks.EarlyStopping(monitor="val_reg_loss", mode="min", patience=1, min_delta=0.5,
                                             restore_best_weights=True)
        history = model.fit(x, y, sample_weight={"cls": W_CLS, "reg": W}, batch_size=B, epochs=15, shuffle=False,
                            verbose=0, validation_split=0.25, callbacks=[stop])
        return history, stop

    keras_model = two_headed(dict_io=True, compile_kw=compile_kw())
    want, want_stop = fit(keras_model)
    with ls.MirroredStrategy(replicas).scope():
        model = two_headed(dict_io=True, compile_kw=compile_kw())
    got, got_stop = fit(model)
    assert len(want.history["loss"]) < 15  # stopped early, on the regression head's validation loss
    assert_logs_close(got.history, want.history)
    assert got_stop.stopped_epoch == want_stop.stopped_epoch and got_stop.best_epoch == want_stop.best_epoch
    assert_weights_close(model.get_weights(), keras_model.get_weights())  # the restored best weights
    got_pred = model.predict(x, batch_size=B, verbose=0)
    assert isinstance(got_pred, dict) and sorted(got_pred) == ["cls", "reg"]
    np.testing.assert_allclose(got_pred["reg"], keras_model.predict(x, verbose=0)["reg"], rtol=1e-5, atol=1e-6)


def test_one_loss_for_every_output_and_metrics_as_a_list_per_output():
    """`loss="mse"` on two outputs: Keras applies it to each and logs each output's loss."""
    def model_():
        keras.utils.set_random_seed(0)
        a = keras.Input((3,))
        h = keras.layers.Dense(6, activation="tanh")(a)
        model = keras.Model(a, [keras.layers.Dense(1, name="first")(h), keras.layers.Dense(2, name="second")(h)])
        model.compile(optimizer="sgd", loss="mse", metrics=[["mae"], ["mae", "mse"]])
        return model

    y = [Y_REG, np.concatenate([Y_REG, XA[:, :1]], axis=1)]
    keras_model = model_()
    want = keras_model.fit(XA, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    with ls.MirroredStrategy(3).scope():
        model = model_()
    assert_logs_close(model.fit(XA, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history, want)
    assert {"first_loss", "second_loss", "first_mae", "second_mae", "second_mse"} <= set(want)


@pytest.mark.parametrize("loss_weights", [0.5, [3.0]])  # a list of one: refused before, Keras takes it
def test_a_single_output_s_loss_weight_scales_its_loss_as_in_keras(loss_weights):
    """Before: `loss_weights` of a one-output model was silently ignored (the loss and its gradients 2x off here)."""
    def model_():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", loss_weights=loss_weights, metrics=["mae"])
        return model

    keras_model = model_()
    want = keras_model.fit(XA, Y_REG, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    with ls.MirroredStrategy(4).scope():
        model = model_()
    assert_logs_close(model.fit(XA, Y_REG, batch_size=B, epochs=2, shuffle=False, verbose=0).history, want)
    assert_weights_close(model.get_weights(), keras_model.get_weights())


def test_what_does_not_fit_the_outputs_is_a_clear_error_and_the_model_is_left_whole():
    with ls.MirroredStrategy(2).scope():
        model = two_headed()
    x = [XA, XB]
    with pytest.raises(ValueError, match=r"`class_weight` is only supported for Models with a single output"):
        model.fit(x, [Y_CLS, Y_REG], class_weight={0: 1.0, 1: 2.0, 2: 1.0}, verbose=0)
    with pytest.raises(ValueError, match=r"`y` holds 3 entries but the model has 2 outputs \['cls', 'reg'\]"):
        model.fit(x, [Y_CLS, Y_REG, Y_REG], verbose=0)
    with pytest.raises(ValueError, match=r"`y` is keyed by \['value'\], which are not outputs of the model"):
        model.fit(x, {"cls": Y_CLS, "value": Y_REG}, verbose=0)
    bad = Y_CLS.copy()
    bad[7] = 3  # the cls head predicts 3 classes
    with pytest.raises(ValueError, match=r"`y\['cls'\]` holds label 3 \(at index 7\), outside the 3 classes"):
        model.fit(x, {"cls": bad, "reg": Y_REG}, verbose=0)
    with pytest.raises(ValueError, match=r"`validation_data\['cls'\]` holds label 3"):
        model.fit(x, [Y_CLS, Y_REG], validation_data=(x, [bad, Y_REG]), verbose=0)
    with pytest.raises(ValueError, match=r"`x` and `y` must have the same number of samples: `x` has 61, `y` has 60"):
        model.fit(x, [Y_CLS, Y_REG[:60]], verbose=0)
    with ls.MirroredStrategy(2).scope():
        flat = two_headed(compile_kw=dict(optimizer="adam", loss=["sparse_categorical_crossentropy", "mse"],
                                          metrics=["accuracy"]))
    with pytest.raises(ValueError, match=r"`metrics` must be given per output for a model with outputs \['cls', 'reg'\]"):
        flat.fit(x, [Y_CLS, Y_REG], verbose=0)
    assert [p.shape for p in model(x)] == [(N, 3), (N, 1)]  # the Keras model is left as it was
    assert [p.shape for p in model.predict(x, verbose=0)] == [(N, 3), (N, 1)]


@pytest.mark.full_suite  # a 2-worker launch (about 25 s): make test-full
@pytest.mark.xdist_group("processes")
def test_on_two_workers_a_model_with_two_outputs_equals_keras_own_fit(tmp_path):
    script = WORKERS / "keras_two_outputs_job.py"
    proc = launch_workers(script, devices=2)
    assert proc.returncode == 0, output_of(proc)
    results = rank_results(proc, 2)
    keras_model = two_headed()
    want = keras_model.fit([XA[:58], XB[:58]], [Y_CLS[:58], Y_REG[:58]], sample_weight=W[:58], batch_size=B, epochs=2,
                           shuffle=False, verbose=0)
    want_eval = keras_model.evaluate([XA, XB], [Y_CLS, Y_REG], batch_size=B, verbose=0)
    for got in results:
        assert_logs_close(got["history"], want.history)
        assert_weights_close([np.asarray(w) for w in got["weights"]], keras_model.get_weights())
        np.testing.assert_allclose(got["evaluate"], want_eval, rtol=2e-5)
