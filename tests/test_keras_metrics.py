"""Keras metric objects as lockstep metrics: on any number of replicas, with padding and short
batches, the value equals the Keras object's own on the same batches (Keras is the reference)."""

import functools

import keras
import numpy as np
import pytest

import lockstep as ls
from suite import FULL, variants

# Keras' own confusion matrices ask JAX for int64 (x64 is off): a warning from Keras, not from lockstep
pytestmark = [pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64"),
              pytest.mark.filterwarnings("ignore:You are passing weight as `float`")]
C = 3
_rng = np.random.default_rng(0)


def _probs(n, c=C):
    z = _rng.normal(size=(n, c))
    return (np.exp(z) / np.exp(z).sum(1, keepdims=True)).astype(np.float32)


def _data(kind, n):
    """(y_true, y_pred) of a kind of metric."""
    if kind == "binary":
        return _rng.integers(0, 2, size=(n, 1)).astype(np.float32), _rng.uniform(size=(n, 1)).astype(np.float32)
    if kind == "onehot":
        return np.eye(C, dtype=np.float32)[_rng.integers(0, C, n)], _probs(n)
    if kind == "sparse":
        return _rng.integers(0, C, size=(n,)), _probs(n)
    if kind == "labels":
        return _rng.integers(0, C, size=(n,)), _rng.integers(0, C, size=(n,))
    return _rng.uniform(0.1, 2, size=(n, 2)).astype(np.float32), _rng.uniform(0.1, 2, size=(n, 2)).astype(np.float32)


KERAS_METRICS = {  # name: (constructor, kind of data)
    "AUC": (lambda: keras.metrics.AUC(), "binary"),
    "AUC_PR": (lambda: keras.metrics.AUC(curve="PR", num_thresholds=50), "binary"),
    "BinaryAccuracy": (keras.metrics.BinaryAccuracy, "binary"),
    "BinaryCrossentropy": (keras.metrics.BinaryCrossentropy, "binary"),
    "BinaryIoU": (keras.metrics.BinaryIoU, "binary"),
    "FalseNegatives": (keras.metrics.FalseNegatives, "binary"),
    "FalsePositives": (keras.metrics.FalsePositives, "binary"),
    "TrueNegatives": (keras.metrics.TrueNegatives, "binary"),
    "TruePositives": (keras.metrics.TruePositives, "binary"),
    "Precision": (keras.metrics.Precision, "binary"),
    "Recall": (keras.metrics.Recall, "binary"),
    "PrecisionAtRecall": (lambda: keras.metrics.PrecisionAtRecall(0.5), "binary"),
    "RecallAtPrecision": (lambda: keras.metrics.RecallAtPrecision(0.5), "binary"),
    "SensitivityAtSpecificity": (lambda: keras.metrics.SensitivityAtSpecificity(0.5), "binary"),
    "SpecificityAtSensitivity": (lambda: keras.metrics.SpecificityAtSensitivity(0.5), "binary"),
    "Hinge": (keras.metrics.Hinge, "binary"),
    "SquaredHinge": (keras.metrics.SquaredHinge, "binary"),
    "CategoricalAccuracy": (keras.metrics.CategoricalAccuracy, "onehot"),
    "CategoricalCrossentropy": (keras.metrics.CategoricalCrossentropy, "onehot"),
    "CategoricalHinge": (keras.metrics.CategoricalHinge, "onehot"),
    "KLDivergence": (keras.metrics.KLDivergence, "onehot"),
    "TopKCategoricalAccuracy": (lambda: keras.metrics.TopKCategoricalAccuracy(k=2), "onehot"),
    "F1Score_macro": (lambda: keras.metrics.F1Score(average="macro"), "onehot"),
    "F1Score_none": (lambda: keras.metrics.F1Score(), "onehot"),
    "FBetaScore_weighted": (lambda: keras.metrics.FBetaScore(average="weighted", beta=2.0), "onehot"),
    "OneHotIoU": (lambda: keras.metrics.OneHotIoU(num_classes=C, target_class_ids=[0, 2]), "onehot"),
    "OneHotMeanIoU": (lambda: keras.metrics.OneHotMeanIoU(num_classes=C), "onehot"),
    "CosineSimilarity": (keras.metrics.CosineSimilarity, "onehot"),
    "Poisson": (keras.metrics.Poisson, "onehot"),
    "SparseCategoricalAccuracy": (keras.metrics.SparseCategoricalAccuracy, "sparse"),
    "SparseCategoricalCrossentropy": (keras.metrics.SparseCategoricalCrossentropy, "sparse"),
    "SparseTopKCategoricalAccuracy": (lambda: keras.metrics.SparseTopKCategoricalAccuracy(k=2), "sparse"),
    "Accuracy": (keras.metrics.Accuracy, "labels"),
    "IoU": (lambda: keras.metrics.IoU(num_classes=C, target_class_ids=[1]), "labels"),
    "MeanIoU": (lambda: keras.metrics.MeanIoU(num_classes=C), "labels"),
    "MeanSquaredError": (keras.metrics.MeanSquaredError, "regression"),
    "MeanAbsoluteError": (keras.metrics.MeanAbsoluteError, "regression"),
    "MeanAbsolutePercentageError": (keras.metrics.MeanAbsolutePercentageError, "regression"),
    "MeanSquaredLogarithmicError": (keras.metrics.MeanSquaredLogarithmicError, "regression"),
    "RootMeanSquaredError": (keras.metrics.RootMeanSquaredError, "regression"),
    "LogCoshError": (keras.metrics.LogCoshError, "regression"),
    "R2Score": (keras.metrics.R2Score, "regression"),
    "PearsonCorrelation": (keras.metrics.PearsonCorrelation, "regression"),
    "ConcordanceCorrelation": (keras.metrics.ConcordanceCorrelation, "regression"),
}


SWEPT = {"AUC", "F1Score_macro", "MeanIoU", "R2Score"}  # make test-full: on 1, 3 and 4 replicas; the others on 3


WEIGHTED = SWEPT | {"Precision", "CategoricalCrossentropy", "MeanSquaredError", "SparseCategoricalAccuracy",
                    "OneHotIoU", "PearsonCorrelation"}  # also with sample weights (suite time)


# make test: one of each family (the other mean-of-a-value metrics and confusion counts share their code)
IN_MAKE_TEST = {"AUC", "AUC_PR", "Precision", "Recall", "FalseNegatives", "SpecificityAtSensitivity",
                "F1Score_macro", "F1Score_none", "FBetaScore_weighted", "MeanIoU", "OneHotIoU", "R2Score",
                "PearsonCorrelation", "ConcordanceCorrelation", "CategoricalCrossentropy", "SparseCategoricalAccuracy", "MeanSquaredError", "RootMeanSquaredError"}


@pytest.mark.parametrize("name,weighted", variants([(n, False) for n in sorted(KERAS_METRICS)] +
                                                   [(n, True) for n in sorted(WEIGHTED)],
                                                   {(n, False) for n in IN_MAKE_TEST} | {(n, True) for n in SWEPT}))
def test_a_keras_metric_object_equals_keras_itself_on_any_replica_count(name, weighted):
    make, kind = KERAS_METRICS[name]
    n = 11  # batches of 4 on 3 replicas: a short last batch, a replica with padding only
    y, p = _data(kind, n)
    w = _rng.uniform(0, 2, size=n).astype(np.float32) if weighted else None
    reference = make()  # on the whole data at once (Keras metrics add up over batches)
    reference.update_state(y, p, sample_weight=w)
    expected = np.asarray(reference.result())
    for r in (1, 3, 4) if name in SWEPT and FULL else (3,):
        s = ls.MirroredStrategy(r)
        m = ls.metrics.get(make())
        assert isinstance(m, ls.metrics.KerasMetric)
        arrays = (y, p) if w is None else (y, p, w)
        ds = s.experimental_distribute_dataset(ls.data.batches(arrays, 4))
        m.build(np.shape(y[:1]), np.shape(p[:1]))
        state = m.init()
        for batch in ds:
            state = s.run(lambda st, b: m.update(st, b[0], b[1], sample_weight=b[2] if len(b) == 3 else None),
                          args=(state, batch))
        np.testing.assert_allclose(np.asarray(m.compute(state)), expected, rtol=2e-5, atol=1e-6,
                                   err_msg=f"{name} on {r} replicas")


def test_keras_metric_objects_in_a_trainer_log_what_keras_evaluate_reports():
    """A `keras.metrics` object in `Trainer(metrics=[...])` failed with UnexpectedTracerError."""
    x = _rng.normal(size=(23, 4)).astype(np.float32)
    y = _rng.integers(0, C, size=23)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(C, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy",
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc"),
                           keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")])
    expected = model.evaluate(x, y, batch_size=5, verbose=0, return_dict=True)
    t = ls.Trainer(model, loss="sparse_categorical_crossentropy",
                   metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc"),
                            keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")],
                   strategy=ls.MirroredStrategy(4))
    got = t.evaluate(x, y, batch_size=5)
    for k in ("loss", "acc", "top2"):
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5)


# --- lockstep's own catalog against the Keras class of the same name ------------------------------
T = 4


def _catalog_data(kind, rank, rng):
    n = 6
    if kind == "binary":
        shape = {1: (n,), 2: (n, 1), 3: (n, T, 1)}[rank]
        return rng.integers(0, 2, shape).astype(np.float32), rng.uniform(size=shape).astype(np.float32)
    if kind in ("onehot", "sparse"):
        shape = {2: (n,), 3: (n, T)}[rank]
        z = rng.normal(size=(*shape, C))
        p = (np.exp(z) / np.exp(z).sum(-1, keepdims=True)).astype(np.float32)
        labels = rng.integers(0, C, shape)
        return (np.eye(C, dtype=np.float32)[labels] if kind == "onehot" else labels), p
    if kind == "labels":
        shape = {1: (n,), 2: (n, 2)}[rank]
        return rng.integers(0, C, shape), rng.integers(0, C, shape)
    shape = {1: (n,), 2: (n, 2), 3: (n, T, 2)}[rank]
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


CATALOG = {  # lockstep name (= Keras name): kind of data, ranks, constructor arguments
    "Accuracy": ("labels", [1, 2], {}), "BinaryAccuracy": ("binary", [1, 2, 3], {}),
    "CategoricalAccuracy": ("onehot", [2, 3], {}), "SparseCategoricalAccuracy": ("sparse", [2, 3], {}),
    "TopKCategoricalAccuracy": ("onehot", [2, 3], {}), "SparseTopKCategoricalAccuracy": ("sparse", [2, 3], {}),
    "AUC": ("binary", [1, 2], {}), "Precision": ("binary", [1, 2, 3], {}), "Recall": ("binary", [1, 2, 3], {}),
    "F1Score": ("onehot", [2], {}), "FBetaScore": ("onehot", [2], {}),
    "MeanAbsoluteError": ("regression", [1, 2, 3], {}), "MeanSquaredError": ("regression", [1, 2, 3], {}),
    "RootMeanSquaredError": ("regression", [1, 2, 3], {}), "R2Score": ("regression", [2], {}),
}


def _weights(form, y, kind, rng):
    per = np.shape(y)[:-1] if kind == "onehot" else np.shape(y)  # one weight per label
    shapes = {"none": None, "per sample": per[:1], "per label": per,
              "per timestep": per[:2] if len(per) >= 2 else None}
    shape = shapes[form]
    return None if shape is None else rng.uniform(0, 2, shape).astype(np.float32)


@pytest.mark.parametrize("name", variants(sorted(CATALOG), {"AUC", "Precision", "BinaryAccuracy", "F1Score", "R2Score",
                                                         "SparseTopKCategoricalAccuracy", "RootMeanSquaredError"}))
def test_a_catalog_metric_equals_the_keras_class_on_the_same_inputs(name):
    """Ranks 1-3, weights per sample, per label and per timestep, and the
    one-element threshold list: wherever Keras computes a value, lockstep's is the same (shape too)."""
    kind, ranks, kwargs = CATALOG[name]
    rng = np.random.default_rng(3)
    compared = 0
    for rank in ranks:
        for form in ("none", "per sample", "per label", "per timestep"):
            y, p = _catalog_data(kind, rank, rng)
            w = _weights(form, y, kind, rng)
            if form != "none" and w is None:
                continue
            reference = getattr(keras.metrics, name)(**kwargs)
            try:
                reference.update_state(y, p, sample_weight=w)
                expected = np.asarray(reference.result())
            except ValueError:  # Keras refuses this weight shape: nothing to compare
                continue
            ours = getattr(ls.metrics, name)(**kwargs)
            ours.update_state(y, p, sample_weight=w)
            got = np.asarray(ours.result())
            assert got.shape == expected.shape, (rank, form)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}, weights {form}")
            compared += 1
    assert compared >= len(ranks)
    if name in ("Precision", "Recall"):  # a list of one threshold gives a scalar, as in Keras
        y, p = _catalog_data("binary", 1, rng)
        reference, ours = getattr(keras.metrics, name)(thresholds=[0.3]), getattr(ls.metrics, name)(thresholds=[0.3])
        reference.update_state(y, p)
        ours.update_state(y, p)
        assert np.shape(ours.result()) == () and np.isclose(float(ours.result()), float(reference.result()))


class _WeightedMAEAndRows(keras.metrics.Metric):
    """A user's metric: a weighted mean absolute error that also counts the rows it saw (every row,
    whatever its weight, as Keras counts them), reporting both."""

    def __init__(self, name="wmae_rows", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.weight = self.add_variable(shape=(), initializer="zeros", name="weight")
        self.rows = self.add_variable(shape=(), initializer="zeros", name="rows")

    def update_state(self, y_true, y_pred, sample_weight=None):
        d = keras.ops.abs(keras.ops.cast(y_true, "float32") - keras.ops.squeeze(y_pred, -1))
        w = keras.ops.ones_like(d) if sample_weight is None else keras.ops.cast(sample_weight, "float32")
        self.total.assign_add(keras.ops.sum(d * w))
        self.weight.assign_add(keras.ops.sum(w))
        self.rows.assign_add(keras.ops.cast(keras.ops.shape(d)[0], "float32"))

    def result(self):
        return self.total / self.weight + 1000.0 * self.rows


@pytest.mark.parametrize("replicas, batch_size", [(1, 23), (3, 4), (8, 3)])
def test_a_users_metric_counting_rows_beside_weighted_sums_keeps_the_weights(replicas, batch_size):
    """One variable of the metric counts rows whatever their weight: lockstep had dropped the user's
    weights from every variable (1.3055 for Keras' 1.2478, on any replica count). Now each real row
    is updated with its own weight (rows of weight 0 counted, as Keras counts them; padding not)."""
    from keras_reference import in_keras_and_lockstep

    rng = np.random.default_rng(3)
    x = rng.normal(size=(23, 5)).astype(np.float32)
    y = (x[:, 0] + rng.normal(size=23)).astype(np.float32)
    w = np.where(np.arange(23) % 5 == 0, 0.0, rng.uniform(0.1, 2, size=23)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", weighted_metrics=[_WeightedMAEAndRows()])
        return model

    def run(model):
        history = model.fit(x, y, sample_weight=w, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
        return history, model.evaluate(x, y, sample_weight=w, batch_size=batch_size, verbose=0, return_dict=True)
    (want, _), (got, _) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(replicas))
    assert want[1]["wmae_rows"] > 23000 and int(want[1]["wmae_rows"] / 1000) == 23
    np.testing.assert_allclose(got[0]["wmae_rows"], want[0]["wmae_rows"], rtol=1e-6)
    np.testing.assert_allclose(got[1]["wmae_rows"], want[1]["wmae_rows"], rtol=1e-6)
    # the same metric updated inside `strategy.run` on a distributed batch
    s = ls.MirroredStrategy(replicas)
    reference = _WeightedMAEAndRows()
    reference.update_state(y, x[:, :1], sample_weight=w)
    m = _WeightedMAEAndRows()

    def step(b):
        m.update_state(b[0], b[1], sample_weight=b[2])
    for batch in s.experimental_distribute_dataset(ls.data.batches((y, x[:, :1], w), batch_size)):
        s.run(step, args=(batch,))
    np.testing.assert_allclose(float(m.result()), float(reference.result()), rtol=1e-6)


def _metric_results(model):
    """Every Keras metric object of `model` (its loss trackers, its compiled metrics) by the name its
    logs give it, and its `result()`: what a user's code reads after `fit`, or a callback in it."""
    out = {}
    for metric in model.metrics:
        result = metric.result()
        for name, value in (result.items() if isinstance(result, dict) else [(metric.name, result)]):
            out[name] = float(np.asarray(value))
    return out


@pytest.mark.parametrize("replicas,steps_per_execution", variants([(1, 1), (3, 1), (8, 1), (3, 2)],
                                                                    {(3, 1), (8, 1), (3, 2)}))
def test_the_models_metric_objects_hold_what_keras_leaves_in_them(replicas, steps_per_execution):
    """After Keras' `fit` or `evaluate`, and in a callback at every hook of them, the model's metric
    objects hold the loop's states: ``acc.result()`` is the value logged (so far, in a batch's
    hooks; reset as an epoch begins, and after `on_test_begin`). lockstep left them at 0 (never
    updated), and after `reset_metrics` `get_metrics_result` still gave the last logs; in the
    hooks of batches the objects held 0 or the last epoch's values, and a callback's
    `get_metrics_result` the last loop's logs. Two outputs, metric objects, names and weighted
    metrics, sample weights; 13 rows in batches of 4: replicas without rows in the last."""
    from keras_reference import in_keras_and_lockstep

    rng = np.random.default_rng(0)
    x = rng.normal(size=(13, 5)).astype(np.float32)
    y = {"a": rng.integers(0, 2, 13), "b": rng.normal(size=(13, 1)).astype(np.float32)}
    w = rng.uniform(0.1, 2, size=13).astype(np.float32)
    sacc = {}

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((5,))
        h = keras.layers.Dense(8, activation="relu")(inp)
        model = keras.Model(inp, {"a": keras.layers.Dense(2, activation="softmax", name="a")(h),
                                  "b": keras.layers.Dense(1, name="b")(h)})
        sacc["object"] = keras.metrics.SparseCategoricalAccuracy(name="sacc")
        model.compile("adam", {"a": "sparse_categorical_crossentropy", "b": "mse"},
                      metrics={"a": ["accuracy", sacc["object"]], "b": ["mae"]},
                      weighted_metrics={"b": [keras.metrics.MeanSquaredError(name="wmse")]},
                      steps_per_execution=steps_per_execution)
        return model

    class Reads(keras.callbacks.Callback):
        """Reads the metric objects (and `get_metrics_result`, and a loss tracker it kept) at every hook."""

        def __init__(self):
            super().__init__()
            self.read = []

        def _read(self, *_, **__):
            self.read.append({**_metric_results(self.model), "kept": float(self.kept.result()),
                              **{f"got_{k}": float(np.asarray(v)) for k, v in self.model.get_metrics_result().items()}})

        def on_train_begin(self, logs=None):
            self.kept = self.model.metrics[0]  # the loss tracker, read from then on without asking the model
        on_epoch_begin = on_epoch_end = on_train_batch_begin = on_train_batch_end = _read
        on_test_begin = on_test_end = on_test_batch_begin = on_test_batch_end = _read

    class KeptOnly(keras.callbacks.Callback):  # in a later evaluate, reads only the object it kept in fit
        def on_train_begin(self, logs=None):
            self.kept, self.read = self.model.metrics[0], []

        def on_test_batch_end(self, batch, logs=None):
            assert self.model is not None  # (Keras' JAX loops give the objects their states as `model` is asked for)
            self.read.append({"kept": float(self.kept.result())})

    def run(model):
        reads, kept = Reads(), KeptOnly()
        model.fit(x, y, sample_weight=w, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[reads, kept],
                  validation_data=(x[:6], {"a": y["a"][:6], "b": y["b"][:6]}))
        fitted, sacc_fitted = _metric_results(model), float(sacc["object"].result())
        model.evaluate(x, y, batch_size=5, verbose=0, callbacks=[reads])
        evaluated = _metric_results(model)
        model.evaluate(x[3:], y={k: v[3:] for k, v in y.items()}, batch_size=3, verbose=0, callbacks=[kept])
        model.reset_metrics()
        return reads.read + kept.read, fitted, sacc_fitted, evaluated, model.get_metrics_result()
    (want, _), (got, _) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(replicas))
    assert len(want[1]) == 7 and want[2] > 0.5 and not any(want[4].values())
    assert len(want[0]) == len(got[0]) > 20 and len({r.get("loss") for r in want[0]}) > 5  # they moved batch by batch
    for g, k in zip([*got[0], got[1], got[3], got[4]], [*want[0], want[1], want[3], want[4]]):
        assert sorted(g) == sorted(k)
        np.testing.assert_allclose([g[n] for n in sorted(g)], [k[n] for n in sorted(k)], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6)


@pytest.mark.parametrize("outputs", [1, 2])
def test_repeated_and_weighted_twins_are_named_and_held_as_keras_names_them(outputs):
    """A metric given twice, or in `metrics` and `weighted_metrics` alike, is logged by Keras as
    ``mae_1`` and ``weighted_mae`` (``a_weighted_mae`` for an output): lockstep logged a second
    ``a_mae_1`` for the weighted twin of an output's metric, and left the objects of repeated names
    (and `R2Score`'s, whose state it named otherwise) unwritten. 3 replicas, 13 rows in batches of 4."""
    from keras_reference import in_keras_and_lockstep

    rng = np.random.default_rng(1)
    x = rng.normal(size=(13, 4)).astype(np.float32)
    y = rng.normal(size=(13, 1)).astype(np.float32)
    w = rng.uniform(0.1, 2, size=13).astype(np.float32)

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((4,))
        if outputs == 1:
            model = keras.Model(inp, keras.layers.Dense(1)(inp))
            model.compile("sgd", "mse", metrics=["mae", "mae", keras.metrics.R2Score()],
                          weighted_metrics=["mae", "mae"])
        else:
            model = keras.Model(inp, {"a": keras.layers.Dense(1, name="a")(inp), "b": keras.layers.Dense(1, name="b")(inp)})
            model.compile("sgd", {"a": "mse", "b": "mse"}, metrics={"a": ["mae", "mae"], "b": ["mse"]},
                          weighted_metrics={"a": ["mae"], "b": ["mse", "mae"]})
        return model

    def run(model):
        ys = y if outputs == 1 else {"a": y, "b": -y}
        history = model.fit(x, ys, sample_weight=w, batch_size=4, epochs=1, shuffle=False, verbose=0).history
        return history, _metric_results(model)
    (want, _), (got, _) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(3))
    assert any("weighted_mae" in k for k in want[0])
    for g, k in zip(got, want):
        assert sorted(g) == sorted(k)
        np.testing.assert_allclose([np.ravel(g[n])[-1] for n in sorted(g)], [np.ravel(k[n])[-1] for n in sorted(k)],
                                   rtol=2e-5, atol=1e-6)


def small_classifier(metrics=("accuracy",), steps_per_execution=1):
    """The loop tests' Keras model (5 features, 2 logits, SGD), seeded as Keras code seeds it."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics),
                  steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("replicas,steps_per_execution", variants([(1, 1), (3, 1), (8, 1), (3, 2)], {(8, 1), (3, 2)}))
def test_a_callback_resetting_the_metrics_in_a_loop_restarts_them_as_keras_does(replicas, steps_per_execution):
    """A callback's ``self.model.reset_metrics()`` in a loop (a window of the running metrics):
    Keras' loops count the loss and metrics again from the next step, so the batches' logs, the
    epoch's and the evaluation's are of the steps since. lockstep went on counting the whole
    loop (the epoch's loss over every batch where Keras gave 0). Reset as batch 2 begins, as batch
    5 ends, as the last batch of epoch 1 ends (its logs: the reset objects'), and after batch 1 of
    an evaluation (fit's validation too); 61 rows in batches of 8: replicas without rows. A
    callback's ``self.model.evaluate()`` after batch 3 (and in the evaluations' batch 3): Keras'
    loop goes on from the metric objects that evaluation left (lockstep's went on from its own)."""
    from keras_reference import in_keras_and_lockstep

    rng = np.random.default_rng(3)
    x = rng.normal(size=(61, 5)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.normal(size=61) > 0).astype(np.int32)

    build = functools.partial(small_classifier, steps_per_execution=steps_per_execution)

    class Windows(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch, self.read = 0, []

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def _reset(self, where):
            self.model.reset_metrics()
            self.read.append((where, self.model.get_metrics_result()))

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:
                self._reset("begin")

        def on_train_batch_end(self, batch, logs=None):
            self.read.append(("end", dict(logs)))
            if batch == 5 or (self.epoch == 1 and batch == 7):
                self._reset("end")
            if batch == 3:
                self.read.append(("evaluated", self.model.evaluate(x[:21], y[:21], batch_size=8, verbose=0,
                                                                   return_dict=True)))

        def on_test_batch_end(self, batch, logs=None):
            self.read.append(("test end", dict(logs)))
            if batch == 1:
                self._reset("test")
            if batch == 3:
                self.model.evaluate(x[:13], y[:13], batch_size=8, verbose=0)

    def run(model):
        windows = Windows()
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[windows],
                            validation_data=(x[:40], y[:40]))
        evaluated = model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[windows], return_dict=True)
        return history.history, windows.read, evaluated

    (want, _), (got, _) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(replicas))
    assert want[0]["loss"][1] == 0 and 0 < want[0]["loss"][0] and len(want[1]) > 10  # Keras' epoch 1 ends reset
    for g, k in [(got[0], want[0]), (got[2], want[2]), *zip([r for _, r in got[1]], [r for _, r in want[1]])]:
        assert sorted(g) == sorted(k)
        np.testing.assert_allclose([g[n] for n in sorted(g)], [k[n] for n in sorted(k)], rtol=2e-5, atol=1e-6)
    assert [w for w, _ in got[1]] == [w for w, _ in want[1]]


@pytest.mark.parametrize("rows,batch_size,replicas,steps_per_execution",
                         variants([(61, 8, 8, 1), (61, 8, 3, 2), (7, 2, 8, 1), (1, 1, 8, 1)],
                                  {(61, 8, 3, 2), (7, 2, 8, 1)}))
def test_a_callback_changing_a_metric_object_in_a_loop_changes_the_loop_as_keras_does(
        rows, batch_size, replicas, steps_per_execution):
    """A Keras callback's change of one metric object in a loop: Keras' JAX loops reread the objects
    at a call's steps where a callback read the model (`self.model`: its state sync) since the last
    steps, or the loop began; what callbacks changed before that read, or with none, is lost (the
    sync overwrites it). lockstep ignored every change (the epoch's accuracy over every batch where
    Keras gave 0). Call by call of the epoch: the compiled metric reset (taken from
    ``self.model.metrics``), a kept reference reset without reading the model, reset and then the
    model read, the model read and then reset, reset after another callback read the model, reset
    with no read before another callback's change; as a call begins, the loss tracker updated with
    5.0, the kept metric updated without a read as the epoch begins and at its first call; in an
    evaluation, every object reset and the loss tracker updated. 61 rows in batches of 8, 7 in
    batches of 2 and one row, on 8 replicas: replicas without rows."""
    from keras_reference import in_keras_and_lockstep

    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.normal(size=rows) > 0).astype(np.int32)
    kept = {}

    def build():
        kept["acc"] = keras.metrics.SparseCategoricalAccuracy(name="acc")
        return small_classifier([kept["acc"]], steps_per_execution)

    class Changes(keras.callbacks.Callback):
        def __init__(self, acc):
            super().__init__()
            self.acc, self.ends, self.begins, self.tests, self.read = acc, 0, 0, 0, []

        def on_epoch_begin(self, epoch, logs=None):
            self.begins = 0
            self.acc.update_state([1], [[0.0, 1.0]])  # (the loop begins synced: taken)

        def on_train_batch_end(self, batch, logs=None):
            self.read.append(("end", dict(logs)))
            self.ends += 1
            if self.ends % 7 == 6:
                self.acc.reset_state()  # lost: the next callback's read syncs after it
            if self.ends % 7 in (5, 6):
                return
            if self.ends % 5 == 1:
                self.model.metrics[-1].reset_state()  # the compiled metrics (their container)
            elif self.ends % 5 == 2:
                self.acc.reset_state()  # the model not read: ignored
            elif self.ends % 5 == 3:
                self.acc.reset_state()
                self.model.stop_training = False  # read after: the change overwritten
            elif self.ends % 5 == 4:
                self.model.stop_training = False
                self.acc.reset_state()  # read before: taken
            self.read.append(("result", self.model.get_metrics_result()))

        def on_train_batch_begin(self, batch, logs=None):
            self.begins += 1
            if self.ends % 7 == 5:
                self.acc.reset_state()  # no read here, but the next callback's since the steps: taken
            if self.begins % 3 == 2:
                self.model.metrics[0].update_state(5.0)  # the loss tracker
            elif self.begins == 1:
                self.acc.update_state([0], [[0.0, 1.0]])  # the epoch's first call: synced, taken

        def on_test_batch_end(self, batch, logs=None):
            self.read.append(("test end", dict(logs)))
            self.tests += 1
            if self.tests % 3 == 1:
                for metric in self.model.metrics:
                    metric.reset_state()
            elif self.tests % 3 == 2:
                self.model.metrics[0].update_state(2.0)

    class Reads(keras.callbacks.Callback):  # another callback, after: reads the model, then updates the metric
        def __init__(self, changes):
            super().__init__()
            self.changes = changes

        def on_train_batch_end(self, batch, logs=None):
            if self.changes.ends % 7 in (5, 6):
                self.model.metrics[-1].metrics[0].update_state([1], [[0.0, 1.0]])

    def run(model):
        changes = Changes(kept["acc"])
        history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                            callbacks=[changes, Reads(changes)],
                            validation_data=(x[:40], y[:40]))
        evaluated = model.evaluate(x, y, batch_size=batch_size, verbose=0, callbacks=[changes], return_dict=True)
        return history.history, changes.read, evaluated, model.get_metrics_result()

    (want, _), (got, _) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(replicas))
    assert any(r["acc"] == 0 for w, r in want[1] if w == "result")  # Keras' own reads show a reset
    assert [w for w, _ in got[1]] == [w for w, _ in want[1]]
    for g, k in [(got[0], want[0]), (got[2], want[2]), (got[3], want[3]), *zip([r for _, r in got[1]], [r for _, r in want[1]])]:
        assert sorted(g) == sorted(k)
        np.testing.assert_allclose([g[n] for n in sorted(g)], [k[n] for n in sorted(k)], rtol=2e-5, atol=1e-6)


def test_the_model_own_reset_metrics_in_a_loop_is_lost_where_no_callback_synced_as_in_keras():
    """``model.reset_metrics()`` on the model itself (a callback's closure over it, not its
    ``self.model``): Keras' loop restarts its metrics where a callback read ``self.model`` since
    the last steps (after batch 4), and its next sync overwrites the reset otherwise (after batches 5
    and 7: the epochs' logs are of batches 5-7). lockstep restarted them every time (0.0)."""
    from keras_reference import in_keras_and_lockstep

    rng = np.random.default_rng(9)
    x = rng.normal(size=(61, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    build = small_classifier

    def run(model):
        class Closure(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 4:
                    self.model.stop_training = False  # a sync
                if batch in (4, 5, 7):
                    model.reset_metrics()

        return model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[Closure()]).history

    (want, _), (got, _) = in_keras_and_lockstep(build, run, ls.MirroredStrategy(3))
    assert 0 < want["loss"][0] and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)


def test_a_metric_object_changed_holding_an_earlier_batch_state_is_named():
    """A callback that updates a metric object it kept, after reading the model but not its metrics
    (which lockstep gives the running state when a hook reads them): a clear error, not a number
    Keras would not give."""
    acc = keras.metrics.SparseCategoricalAccuracy(name="acc")
    with ls.MirroredStrategy(2).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[acc])

    class Updates(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = False
                acc.update_state([1], [[0.0, 1.0]])

    x, y = np.ones((8, 3), np.float32), np.ones(8, np.int32)
    with pytest.raises(ls.UsageError, match=r"a callback changed the metric object\(s\) \['acc'\] other than by "
                                            r"reset_state\(\) .*Take them from `self.model.metrics`"):
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[Updates()])


@pytest.mark.parametrize("how", ["reset_metrics", "reset_state"])
def test_a_backup_taken_in_the_hook_that_resets_the_metrics_resumes_to_keras_uninterrupted_logs(tmp_path, how):
    """`BackupAndRestore` (every batch) backs up after a callback reset the metrics at batch 5's
    end (the model's `reset_metrics()`, or each metric object's `reset_state()`); a fit interrupted
    after batch 6 and resumed from that backup logs what Keras' own uninterrupted fit logs (before:
    the backup held the counts from before the reset)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(61, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    build = small_classifier

    class ResetAt5(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5 and how == "reset_metrics":
                self.model.reset_metrics()
            elif batch == 5:
                for metric in self.model.metrics:
                    metric.reset_state()

    class InterruptAt6(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 6:
                raise KeyboardInterrupt

    fit = dict(x=x, y=y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    want = build().fit(**fit, callbacks=[ResetAt5()]).history
    strategy = ls.MirroredStrategy(3)
    with strategy.scope():
        model = build()
    with pytest.raises(KeyboardInterrupt):
        model.fit(**fit, callbacks=[ResetAt5(), keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=1), InterruptAt6()])
    with strategy.scope():
        resumed = build()
    got = resumed.fit(**fit, callbacks=[ResetAt5(), keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=1)]).history
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-6, err_msg=name)
