"""Metrics under 1..8 replicas against scikit-learn / NumPy / Keras, with and without weights."""

import functools
import os

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits
from sklearn.linear_model import LinearRegression, LogisticRegression

import lockstep as ls
from suite import variants

FULL = os.environ.get("LOCKSTEP_FULL_SUITE") == "1"  # make test-full draws more examples

REPLICAS = [1, 2, 3, 8]


@functools.cache
def binary_data():
    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    p = LogisticRegression(C=0.05, max_iter=500).fit(x[::2], y[::2]).predict_proba(x)[:, 1]
    return y.astype(np.float32), p.astype(np.float32)


@functools.cache
def multiclass_data():
    x, y = load_digits(return_X_y=True)
    p = LogisticRegression(C=1e-4, max_iter=300).fit(x[::3], y[::3]).predict_proba(x)
    return y.astype(np.int32), p.astype(np.float32)


@functools.cache
def regression_data():
    x, y = load_diabetes(return_X_y=True)
    y = (y - y.mean()) / y.std()
    p = LinearRegression().fit(x[::2], y[::2]).predict(x)
    return y.astype(np.float32), p.astype(np.float32)


def int_weights(n, seed=0):
    return np.random.default_rng(seed).integers(0, 4, size=n).astype(np.float32)  # exact in float32


def _update(metric, state, batch):
    return metric.update(state, *batch[:2], sample_weight=batch[2] if len(batch) > 2 else None)


def _update_values(metric, state, batch):
    return metric.update(state, batch[0], sample_weight=batch[1])


def distributed(metric, arrays, replicas, batch_size=64, update=_update):
    """The metric over `arrays`, computed under MirroredStrategy(replicas) with the functional face."""
    s = ls.MirroredStrategy(replicas)
    if not metric.built:
        metric.build(arrays[0].shape, arrays[1].shape)
    state = metric.init()
    for batch in s.experimental_distribute_dataset(ls.data.batches(tuple(arrays), batch_size)):
        state = s.run(update, args=(metric, state, batch))
    return np.asarray(metric.compute(state))


def eager(metric, arrays, batch_size=64):
    for i in range(0, len(arrays[0]), batch_size):
        part = [a[i:i + batch_size] for a in arrays]
        metric.update_state(*part[:2], sample_weight=part[2] if len(part) > 2 else None)
    return np.asarray(metric.result())


@pytest.mark.parametrize("r", variants(REPLICAS, {3, 8}))
@pytest.mark.parametrize("weighted", [False, True])
def test_binary_metrics_match_sklearn(r, weighted):
    y, p = binary_data()
    w = int_weights(len(y)) if weighted else None
    arrays = (y, p) if w is None else (y, p, w)
    hard = (p > 0.5).astype(np.float32)
    assert distributed(ls.metrics.Precision(), arrays, r) == np.float32(skm.precision_score(y, hard, sample_weight=w))
    assert distributed(ls.metrics.Recall(), arrays, r) == np.float32(skm.recall_score(y, hard, sample_weight=w))
    assert distributed(ls.metrics.BinaryAccuracy(), arrays, r) == np.float32(
        skm.accuracy_score(y, hard, sample_weight=w))
    prec = distributed(ls.metrics.Precision(thresholds=[0.2, 0.5, 0.8]), arrays, r)
    for got, t in zip(prec, [0.2, 0.5, 0.8]):
        assert got == np.float32(skm.precision_score(y, p > t, sample_weight=w))
    auc = distributed(ls.metrics.AUC(num_thresholds=2000), arrays, r)
    np.testing.assert_allclose(auc, skm.roc_auc_score(y, p, sample_weight=w), atol=2e-3)
    pr = distributed(ls.metrics.AUC(num_thresholds=2000, curve="PR"), arrays, r)
    np.testing.assert_allclose(pr, skm.average_precision_score(y, p, sample_weight=w), atol=1e-2)


@pytest.mark.parametrize("curve", ["ROC", "PR"])
@pytest.mark.parametrize("num_thresholds", [3, 50, 200])
def test_auc_equals_keras_auc_on_the_same_thresholds(curve, num_thresholds):
    y, p = binary_data()
    w = int_weights(len(y), seed=1)
    ref = keras.metrics.AUC(num_thresholds=num_thresholds, curve=curve)
    ref.update_state(y, p, sample_weight=w)
    got = distributed(ls.metrics.AUC(num_thresholds=num_thresholds, curve=curve), (y, p, w), 8)
    np.testing.assert_allclose(got, float(ref.result()), rtol=1e-5)


def test_multi_label_auc_equals_keras():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, size=(301, 4)).astype(np.float32)
    p = np.clip(y * 0.3 + rng.uniform(size=(301, 4)) * 0.7, 0, 1).astype(np.float32)
    ref = keras.metrics.AUC(num_thresholds=100, multi_label=True)
    ref.update_state(y, p)
    got = distributed(ls.metrics.AUC(num_thresholds=100, multi_label=True), (y, p), 3)
    np.testing.assert_allclose(got, float(ref.result()), rtol=1e-5)
    per_label = np.mean([skm.roc_auc_score(y[:, j], p[:, j]) for j in range(4)])
    np.testing.assert_allclose(got, per_label, atol=1e-2)


@pytest.mark.parametrize("r", variants(REPLICAS, {3}))
@pytest.mark.parametrize("weighted", [False, True])
def test_multiclass_metrics_match_sklearn(r, weighted):
    y, p = multiclass_data()
    w = int_weights(len(y), seed=2) if weighted else None
    arrays = (y, p) if w is None else (y, p, w)
    hard = p.argmax(1)
    labels = np.arange(10)
    for average in ["micro", "macro", "weighted", None]:
        got = distributed(ls.metrics.F1Score(average=average), arrays, r)
        want = skm.f1_score(y, hard, labels=labels, average=average, sample_weight=w, zero_division=0)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    got = distributed(ls.metrics.FBetaScore(average="macro", beta=2.0), arrays, r)
    np.testing.assert_allclose(got, skm.fbeta_score(y, hard, beta=2.0, labels=labels, average="macro",
                                                    sample_weight=w, zero_division=0), rtol=1e-6)
    cm = distributed(ls.metrics.ConfusionMatrix(num_classes=10), arrays, r)
    np.testing.assert_array_equal(cm, skm.confusion_matrix(y, hard, labels=labels, sample_weight=w))
    assert distributed(ls.metrics.SparseCategoricalAccuracy(), arrays, r) == np.float32(
        skm.accuracy_score(y, hard, sample_weight=w))
    np.testing.assert_allclose(distributed(ls.metrics.SparseTopKCategoricalAccuracy(k=3), arrays, r),
                               skm.top_k_accuracy_score(y, p, k=3, labels=labels, sample_weight=w), rtol=1e-6)
    onehot = np.eye(10, dtype=np.float32)[y]
    arrays_1h = (onehot, p) if w is None else (onehot, p, w)
    assert distributed(ls.metrics.CategoricalAccuracy(), arrays_1h, r) == np.float32(
        skm.accuracy_score(y, hard, sample_weight=w))
    # Precision for one class and for the top-1 prediction, NumPy by hand
    got = distributed(ls.metrics.Precision(class_id=3), arrays_1h, r)
    pos = p[:, 3] > 0.5
    ww = np.ones(len(y)) if w is None else w
    np.testing.assert_allclose(got, np.sum(ww * pos * (y == 3)) / max(np.sum(ww * pos), 1e-12), rtol=1e-6)
    got = distributed(ls.metrics.Recall(top_k=1), arrays_1h, r)
    np.testing.assert_allclose(got, np.sum(ww * (hard == y)) / np.sum(ww), rtol=1e-6)


@pytest.mark.parametrize("r", variants(REPLICAS, {3, 8}))
@pytest.mark.parametrize("weighted", [False, True])
def test_regression_metrics_match_sklearn(r, weighted):
    y, p = regression_data()
    w = int_weights(len(y), seed=4) if weighted else None
    arrays = (y, p) if w is None else (y, p, w)
    np.testing.assert_allclose(distributed(ls.metrics.MeanSquaredError(), arrays, r),
                               skm.mean_squared_error(y, p, sample_weight=w), rtol=1e-6)
    np.testing.assert_allclose(distributed(ls.metrics.MeanAbsoluteError(), arrays, r),
                               skm.mean_absolute_error(y, p, sample_weight=w), rtol=1e-6)
    np.testing.assert_allclose(distributed(ls.metrics.RootMeanSquaredError(), arrays, r),
                               np.sqrt(skm.mean_squared_error(y, p, sample_weight=w)), rtol=1e-6)
    # R² is formed from float32 sums (Σwy² − (Σwy)²/Σw), see R2Score's docstring
    np.testing.assert_allclose(distributed(ls.metrics.R2Score(), arrays, r),
                               skm.r2_score(y, p, sample_weight=w), rtol=1e-5)


def test_multi_output_r2_and_adjusted_r2():
    rng = np.random.default_rng(5)
    y = rng.normal(size=(257, 3)).astype(np.float32)
    p = (y + rng.normal(size=(257, 3)) * [0.1, 0.5, 1.0]).astype(np.float32)
    for agg, sk in [("uniform_average", "uniform_average"), ("variance_weighted_average", "variance_weighted"),
                    (None, "raw_values")]:
        np.testing.assert_allclose(distributed(ls.metrics.R2Score(class_aggregation=agg), (y, p), 3),
                                   skm.r2_score(y, p, multioutput=sk), rtol=1e-5)
    ref = keras.metrics.R2Score(num_regressors=2)
    ref.update_state(y[:, :1], p[:, :1])  # single output: Keras' n (elements) is the sample count
    np.testing.assert_allclose(distributed(ls.metrics.R2Score(num_regressors=2), (y[:, :1], p[:, :1]), 8),
                               float(ref.result()), rtol=1e-5)
    r2 = skm.r2_score(y, p)
    np.testing.assert_allclose(distributed(ls.metrics.R2Score(num_regressors=2), (y, p), 8),
                               1 - (1 - r2) * (257 - 1) / (257 - 2 - 1), rtol=1e-5)


@pytest.mark.parametrize("r", variants(REPLICAS, {3, 8}))
@pytest.mark.parametrize("n", [1, 5, 65, 1003])
def test_reduction_metrics_match_numpy_including_padding_only_replicas(r, n):
    rng = np.random.default_rng(n)
    v = rng.normal(size=n).astype(np.float32)
    w = int_weights(n, seed=n)
    w[0] = 1.0  # at least one sample counts
    for metric, want in [(ls.metrics.Mean(), np.average(v, weights=w)), (ls.metrics.Sum(), np.sum(v * w)),
                         (ls.metrics.Max(), v[w > 0].max()), (ls.metrics.Min(), v[w > 0].min())]:
        np.testing.assert_allclose(distributed(metric, (v, w), r, update=_update_values), want, rtol=1e-5, atol=1e-6)


def test_mean_of_per_replica_scalar_losses_is_sample_weighted():
    # a per-replica scalar (say, the replica's mean loss) counts with its replica's real samples
    s = ls.MirroredStrategy(8)
    x = np.arange(13, dtype=np.float32)
    m = ls.metrics.Mean()
    state = m.init()

    def step(state, b):
        local_mean = jnp.sum(jnp.where(ls.get_replica_context().mask > 0, b, 0)) / jnp.sum(ls.get_replica_context().mask)
        return m.update(state, local_mean)

    for batch in s.experimental_distribute_dataset(ls.data.batches(x, 10)):
        state = s.run(step, args=(state, batch))
    np.testing.assert_allclose(m.compute(state), x.mean(), rtol=1e-6)


def test_averaging_per_replica_f1_is_wrong_and_lockstep_is_exact():
    y, p = multiclass_data()
    y, p = y[:203], p[:203]
    s = ls.MirroredStrategy(4)
    m = ls.metrics.F1Score(average="macro", num_classes=10)
    batch = next(iter(s.experimental_distribute_dataset([(y, p)])))
    state = s.run(_update, args=(m, m.init(), batch))
    # what Horovod's MetricAverageCallback / per-replica logs do: average each replica's F1
    per_replica_f1 = s.run(lambda st: m.result_from(st), args=(state,))
    naive = float(s.reduce("MEAN", per_replica_f1))
    true = skm.f1_score(y, p.argmax(1), labels=np.arange(10), average="macro", zero_division=0)
    assert abs(naive - true) > 1e-3
    np.testing.assert_allclose(m.compute(state), true, rtol=1e-6)
    # inside run, compute() all-reduces the state first: every replica gets the exact value
    inside = s.run(lambda st: m.compute(st), args=(state,))
    assert isinstance(inside, ls.Mirrored)
    np.testing.assert_allclose(np.asarray(inside), true, rtol=1e-6)


def test_eager_face_matches_functional_face_and_resets():
    y, p = multiclass_data()
    m = ls.metrics.F1Score(average="weighted")
    got = eager(m, (y, p), batch_size=100)
    np.testing.assert_allclose(got, skm.f1_score(y, p.argmax(1), average="weighted"), rtol=1e-6)
    m.reset_state()
    assert float(m.result()) == 0.0
    assert float(ls.metrics.Mean().result()) == 0.0  # Keras: 0 before any update, not NaN
    assert float(ls.metrics.AUC().result()) == 0.0
    assert float(ls.metrics.Precision().result()) == 0.0


def test_collection_reads_all_states_in_one_reduction_and_matches_each_metric():
    y, p = multiclass_data()
    names = ["accuracy", "sparse_top_k_categorical_accuracy", ls.metrics.F1Score(average="macro"),
             ls.metrics.ConfusionMatrix(10)]
    c = ls.metrics.MetricCollection(names)
    c.build(y.shape, p.shape)
    s = ls.MirroredStrategy(3)
    state = c.init()
    def update(st, b):
        return c.update(st, b[0], b[1])
    for batch in s.experimental_distribute_dataset(ls.data.batches((y, p), 256)):  # a short last batch of 5
        state = s.run(update, args=(state, batch))
    reads = []
    run = s.extended.run_to_host
    s.extended.run_to_host = lambda fn, *a, **k: (reads.append(fn), run(fn, *a, **k))[1]
    psums = []
    psum = jax.lax.psum
    jax.lax.psum = lambda x, axis: (psums.append(len(jax.tree.leaves(x))), psum(x, axis))[1]
    try:
        out = c.compute(state)
    finally:
        s.extended.run_to_host, jax.lax.psum = run, psum
    assert len(reads) == 1  # one program reads every state of every metric...
    # ...with one all-reduce of all their sum states (traced twice: the probe for mirrored outputs, then the compile)
    assert psums == [len(c._specs())] * len(psums) and 1 <= len(psums) <= 2
    assert set(out) == {"accuracy", "sparse_top_k_categorical_accuracy", "f1_score", "confusion_matrix"}
    assert float(out["accuracy"]) == np.float32(skm.accuracy_score(y, p.argmax(1)))
    np.testing.assert_allclose(out["f1_score"], skm.f1_score(y, p.argmax(1), average="macro"), rtol=1e-6)
    np.testing.assert_array_equal(out["confusion_matrix"], skm.confusion_matrix(y, p.argmax(1)))


def test_string_names_resolve_the_keras_way():
    y, p = binary_data()
    acc = ls.metrics.get("accuracy")
    acc.update_state(y, p)
    assert type(acc._inner).__name__ == "BinaryAccuracy"
    acc = ls.metrics.get("accuracy")
    yc, pc = multiclass_data()
    acc.update_state(yc, pc)
    assert type(acc._inner).__name__ == "SparseCategoricalAccuracy"
    assert float(acc.result()) == np.float32(skm.accuracy_score(yc, pc.argmax(1)))
    with pytest.raises(ValueError, match="unknown metric 'f2'"):
        ls.metrics.get("f2")


# --- properties ---------------------------------------------------------------------------
SPLIT_F1 = ls.metrics.F1Score(average="macro", num_classes=4)
SPLIT_CM = ls.metrics.ConfusionMatrix(4)


@settings(max_examples=20 if FULL else 5, deadline=None)
@given(n=st.integers(1, 150), batch_size=st.sampled_from([1, 7, 64]), r=st.sampled_from([1, 3, 8]),
       seed=st.integers(0, 2 ** 16))
def test_any_split_into_batches_and_replicas_equals_the_one_shot_metric(n, batch_size, r, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, size=n).astype(np.int32)
    p = rng.dirichlet(np.ones(4), size=n).astype(np.float32)
    w = rng.integers(0, 3, size=n).astype(np.float32)
    w[0] = 1.0
    labels = np.arange(4)
    np.testing.assert_allclose(
        distributed(SPLIT_F1, (y, p, w), r, batch_size),
        skm.f1_score(y, p.argmax(1), labels=labels, average="macro", sample_weight=w, zero_division=0),
        rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(distributed(SPLIT_CM, (y, p, w), r, batch_size),
                                  skm.confusion_matrix(y, p.argmax(1), labels=labels, sample_weight=w))


MERGE = ls.metrics.MetricCollection([ls.metrics.F1Score(average=None, num_classes=3),
                                     ls.metrics.AUC(num_thresholds=20, multi_label=True, num_labels=3)])
MERGE_UPDATE = jax.jit(lambda y, p: MERGE.update(MERGE.init(), y, p))
MAX = ls.metrics.Max()
MAX_UPDATE = jax.jit(lambda v: MAX.update(MAX.init(), v))


@settings(max_examples=20 if FULL else 10, deadline=None)
@given(seed=st.integers(0, 2 ** 16), sizes=st.tuples(*[st.sampled_from([1, 7, 40])] * 3))
def test_merge_is_associative_and_commutative(seed, sizes):
    rng = np.random.default_rng(seed)
    states = []
    for n in sizes:
        y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, size=n)]
        p = rng.dirichlet(np.ones(3), size=n).astype(np.float32)
        states.append((MERGE_UPDATE(y, p), MAX_UPDATE(p[:, 0])))
    (a, xa), (b, xb), (c, xc) = states
    m = MERGE
    left, right = m.merge(m.merge(a, b), c), m.merge(a, m.merge(b, c))
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6), left, right)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6), m.merge(a, b), m.merge(b, a))
    jax.tree.map(np.testing.assert_array_equal, MAX.merge(MAX.merge(xa, xb), xc), MAX.merge(xa, MAX.merge(xb, xc)))
    jax.tree.map(np.testing.assert_array_equal, MAX.merge(xa, xb), MAX.merge(xb, xa))


# --- misuse -------------------------------------------------------------------------------
def test_clear_errors():
    with pytest.raises(ValueError, match="same number of samples"):
        ls.metrics.Mean().update(ls.metrics.Mean().init(), np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match=r"labels outside \[0, 3\).*max 5"):
        ls.metrics.F1Score(num_classes=3).update_state(np.array([0, 5]), np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"y_true.*outside \[0, 2\)"):
        ls.metrics.ConfusionMatrix(2).update_state([0, 2], [0, 1])
    with pytest.raises(ValueError, match="average='mean'"):
        ls.metrics.F1Score(average="mean")
    with pytest.raises(ValueError, match=r"thresholds.*\[0, 1\].*1.5"):
        ls.metrics.Precision(thresholds=[0.5, 1.5])
    with pytest.raises(ValueError, match="threshold=-0.1"):
        ls.metrics.F1Score(threshold=-0.1)
    with pytest.raises(ValueError, match="num_thresholds=1"):
        ls.metrics.AUC(num_thresholds=1)
    with pytest.raises(ValueError, match=r"same shape"):
        ls.metrics.Precision().update_state(np.ones((4, 2)), np.ones((4, 3)))
    assert ls.metrics.F1Score().init() == {}  # unshaped: the first update shapes it (as Keras builds lazily)
    with pytest.raises(ls.UsageError, match="num_classes"):
        ls.metrics.F1Score().state_specs
    s = ls.MirroredStrategy(2)
    m = ls.metrics.Mean()
    batch = next(iter(s.experimental_distribute_dataset([np.ones(4)])))
    with pytest.raises(ls.UsageError, match="functional face"):
        s.run(lambda b: m.update_state(b), args=(batch,))
    with pytest.raises(ValueError, match="this replica's rows"):
        s.run(lambda st, b: m.update(st, jnp.ones(7)), args=(m.init(), batch))
