"""Bad input that crashed deep inside JAX, NumPy, Grain or the cluster setup (a raw
``dot_general requires contracting dimensions``, "Cannot broadcast to shape with fewer
dimensions", "invalid literal for int()") is a clear error naming the argument, what was expected
and what was received, raised before any step."""

import json

import grain
import keras
import numpy as np
import pytest

import lockstep as ls

import common  # noqa: E402

X, Y = common.data(64)  # 8 features
X5 = np.ones((16, 5), np.float32)


def functional():
    return ls.Trainer(common.model(), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                      strategy=ls.MirroredStrategy(2))


def keras_trainer():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    return ls.Trainer(model, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                      strategy=ls.MirroredStrategy(2))


def trained(make):
    t = make()
    t.fit(X, Y, batch_size=16, verbose=0)
    return t


def batches():
    yield X[:16], Y[:16]
    yield X5, Y[:16]


TOLD = r"has samples of shape \(5,\), which the model cannot take: it took samples of shape \(8,\) \("
CASES = {
    "validation_data": (lambda t: t.fit(X, Y, batch_size=16, verbose=0, validation_data=(X5, Y[:16])),
                        r"`validation_data` " + TOLD),
    "predict": (lambda t: trained(lambda: t).predict(X5), r"`x` " + TOLD),
    "evaluate": (lambda t: trained(lambda: t).evaluate(X5, Y[:16]), r"`x` " + TOLD),
    "a second fit": (lambda t: trained(lambda: t).fit(X5, Y[:16], verbose=0), r"`x` " + TOLD),
    "a generator's second batch": (lambda t: t.fit(batches(), verbose=0), r"`x` \(batch 2\) " + TOLD),
    "sample_weight (N, 3)": (lambda t: t.fit(X, Y, sample_weight=np.ones((64, 3)), verbose=0),
                             r"`sample_weight` has shape \(64, 3\), but it takes one weight per sample, shape \(64,\)"),
    "no samples": (lambda t: t.fit(X[:0], Y[:0], verbose=0), r"`x` holds no samples \(length 0\)"),
    "no samples to predict": (lambda t: trained(lambda: t).predict(X[:0]), r"`x` holds no samples \(length 0\)"),
}


@pytest.mark.parametrize("make", [functional, keras_trainer], ids=["FunctionalModel", "Keras"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inputs_the_model_cannot_take_are_named_before_any_step(case, make):
    call, match = CASES[case]
    t = make()
    with pytest.raises(ValueError, match=match):
        call(t)


def test_1d_x_for_a_keras_model_is_named():
    with pytest.raises(ValueError, match=r"`x` has samples of shape \(\), which the model cannot take \(.*Expected "
                                         r"shape \(None, 8\)"):
        keras_trainer().fit(X[:, 0], Y, verbose=0)


def test_an_lstm_on_sequences_of_varying_length_is_not_refused():
    """The check traces each new per-sample shape once: a model that takes several is not refused."""
    model = keras.Sequential([keras.Input((None, 2)), keras.layers.LSTM(3), keras.layers.Dense(2)])
    t = ls.Trainer(model, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(2))
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(4, steps, 2)).astype(np.float32), np.array([0, 1, 0, 1])) for steps in (3, 5, 3, 7)]
    assert len(t.fit(data, verbose=0).history["loss"]) == 1


def test_a_grain_sample_of_another_shape_is_named_by_index():
    class Source:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return (X[i] if i != 37 else np.ones(5, np.float32)), Y[i]
    with pytest.raises(ValueError, match=r"sample 37 of the source has shapes \(\(5,\), \(\)\), sample \d+ has "
                                         r"\(\(8,\), \(\)\)"):
        functional().fit(grain.MapDataset.source(Source()), batch_size=16, verbose=0)


def test_an_unbatched_tf_data_dataset_is_named():
    tf = pytest.importorskip("tensorflow")
    with pytest.raises(ValueError, match=r"the tf.data dataset's elements are single samples, not batches \(element 1"
                                         r" of .* is a scalar\): batch it"):
        functional().fit(tf.data.Dataset.from_tensor_slices((X, Y)), verbose=0)


@pytest.mark.parametrize("index, ok", [("one", False), (5, False), (-1, False), (True, False), ("1", True), (1, True)])
def test_a_tf_config_task_index_is_checked(index, ok):
    cfg = json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": index}})
    if ok:
        assert ls.TFConfigClusterResolver(cfg).task_id == 1
    else:
        with pytest.raises(ValueError, match=rf"TF_CONFIG's task index must be an integer in \[0, 2\) \(the cluster "
                                             rf"lists 2 'worker' tasks\), got {index!r}"):
            ls.TFConfigClusterResolver(cfg)


def test_a_layout_map_key_that_is_no_regular_expression_is_named():
    layout = ls.LayoutMap(ls.DeviceMesh((2, 2), ("batch", "model")))
    with pytest.raises(ValueError, match=r"the LayoutMap key '\.\*dense\[/kernel' is not a regular expression: "
                                         r"unterminated character set"):
        layout[".*dense[/kernel"] = (None, "model")
    layout[".*dense.*/kernel"] = (None, "model")  # a good one is taken
    assert layout[".*dense.*/kernel"] == (None, "model")
