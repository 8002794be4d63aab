"""Grain input: a `grain.MapDataset` of samples is batched globally and read per worker, by index."""

import collections
import json

import grain
import jax
import numpy as np
import pytest

import lockstep as ls

import common  # noqa: E402
from launching import WORKERS, launch_workers, output_of  # noqa: E402
from keras_reference import assert_logs_close  # noqa: E402
from suite import variants  # noqa: E402


class CountingSource:
    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, collections.Counter()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads[int(i)] += 1
        return self.x[i], self.y[i]


def train(strategy, data, **kwargs):
    t = common.trainer(strategy)
    hist = t.fit(data, batch_size=32, epochs=2, seed=4, verbose=0, **kwargs)
    return t, hist.history


@pytest.mark.parametrize("replicas", variants([1, 3, 4], {3}))
def test_a_map_dataset_trains_evaluates_and_predicts_as_the_same_arrays(replicas):
    x, y = common.data(203)
    source = CountingSource(x, y)
    dataset = grain.MapDataset.source(source).map(lambda s: (s[0] * 2.0, s[1]))
    got, got_hist = train(ls.MirroredStrategy(replicas), dataset)
    assert set(source.reads) == set(range(203))
    assert source.reads[0] == 3 and all(v == 2 for i, v in source.reads.items() if i)  # 2 epochs + 1 shape probe
    want, want_hist = train(ls.MirroredStrategy(replicas), 2.0 * x, y=y)
    for a, b in zip(jax.tree.leaves(got.get_weights()), jax.tree.leaves(want.get_weights())):
        np.testing.assert_array_equal(a, b)  # the same order and batches
    # the arrays stay on the devices and their steps gather the rows (another program than the
    # Grain batches' placed ones): the logged mean loss may differ in its last bit
    assert_logs_close(got_hist, want_hist, rtol=1e-6, atol=0)
    assert got.evaluate(dataset, batch_size=32) == want.evaluate(2.0 * x, y, batch_size=32)
    np.testing.assert_array_equal(got.predict(dataset, batch_size=32), want.predict(2.0 * x, batch_size=32))


class ResizedAfterEpoch(ls.callbacks.Callback):
    """After the first epoch, the source holds `x`, `y`."""

    def __init__(self, source, x, y):
        super().__init__()
        self.source, self.x, self.y = source, x, y

    def on_epoch_end(self, epoch, logs=None):
        self.source.x, self.source.y = self.x, self.y


@pytest.mark.parametrize("first, then", [(200, 120), (120, 200)])
def test_a_map_dataset_whose_length_changes_between_passes_is_refused(first, then):
    """Before, shrinking 200 -> 120 trained epoch 2 on 200 rows (Grain wraps indices: 80 samples
    twice), and growing 120 -> 200 never read the 80 new samples."""
    x, y = common.data(200)
    source = CountingSource(x[:first], y[:first])
    resized = ResizedAfterEpoch(source, x[:then], y[:then])
    with pytest.raises(ValueError, match=rf"the source of samples changed length between passes: {first} samples "
                                         rf"when reading began, {then} at pass 1"):
        train(ls.MirroredStrategy(2), grain.MapDataset.source(source), callbacks=[resized])


def test_a_map_dataset_with_y_is_refused():
    x, y = common.data(20)
    with pytest.raises(ValueError, match="`y` and `sample_weight` must be None"):
        common.trainer(ls.MirroredStrategy(2)).fit(grain.MapDataset.source(CountingSource(x, y)), y, verbose=0)


def expected_reads(n, batch, workers, seed, epochs):
    """Which samples each worker keeps (one replica per worker), computed from the global order."""
    per = collections.defaultdict(collections.Counter)
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(n)
        b = -(-batch // workers)
        for lo in range(0, n, batch):
            idx = order[lo:lo + batch]
            for w in range(workers):
                per[w].update(int(i) for i in idx[w * b:(w + 1) * b])
    return per


@pytest.mark.xdist_group("processes")
@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.full_suite)])
def test_each_worker_reads_only_its_own_samples(workers, tmp_path):
    proc = launch_workers(WORKERS / "grain_job.py", tmp_path, nproc=workers, failure_timeout=10)
    assert proc.returncode == 0, output_of(proc)
    want = expected_reads(203, 32, workers, seed=4, epochs=2)
    total = collections.Counter()
    for w in range(workers):
        reads = json.loads((tmp_path / f"reads{w}.json").read_text())
        fit = collections.Counter(reads["fit"])
        fit[0] -= 1  # the one read of sample 0 that gives the shapes
        assert +fit == want[w], f"worker {w} read other samples than its own"
        evaluate = collections.Counter(reads["evaluate"])
        evaluate[0] -= 1  # evaluate's own shape probe
        total.update(+evaluate)
        total.update(+fit)
    # over 2 epochs and one evaluation, every sample read 3 times in all, by one worker each time
    assert set(total.values()) == {3} and len(total) == 203
    x, y = common.data(203)
    reference, ref_hist = train(ls.MirroredStrategy(workers), 2.0 * x, y=y)
    result = json.loads((tmp_path / "result.json").read_text())
    np.testing.assert_allclose(np.load(tmp_path / "final.npz")["weights"], common.flat(reference.get_weights()),
                               rtol=1e-5, atol=1e-6)
    for k, v in ref_hist.items():
        np.testing.assert_allclose(result["history"][k], v, rtol=1e-5, atol=1e-6)
    for k, v in reference.evaluate(2.0 * x, y, batch_size=32).items():
        np.testing.assert_allclose(result["evaluate"][k], v, rtol=1e-5, atol=1e-6)
