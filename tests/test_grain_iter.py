"""Grain `IterDataset` / `DataLoader` input: each worker's own batches, its iterator state in backups;
and the training data as one stream across epochs (`steps_per_epoch`), checked on resume."""

import collections
import json

import grain
import jax
import numpy as np
import pytest

import lockstep as ls

import common  # noqa: E402
from test_grain import CountingSource  # noqa: E402
from launching import WORKERS, StopAt, Stopped, launch_workers  # noqa: E402
from suite import variants  # noqa: E402

N, B = 203, 32
crossing = pytest.mark.filterwarnings("ignore:a pass over the training data ended inside")
SERIAL = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # no read-ahead: reads can be counted


def iter_dataset(source):
    return grain.MapDataset.source(source).map(lambda s: (s[0] * 2.0, s[1])).to_iter_dataset(SERIAL).batch(B)


def data_loader(source):
    return grain.DataLoader(data_source=source, sampler=grain.samplers.IndexSampler(N, num_epochs=1),
                            operations=[grain.transforms.Batch(B)], worker_count=0)


def weights_close(a, b):
    for u, v in zip(jax.tree.leaves(a.get_weights()), jax.tree.leaves(b.get_weights())):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def weights_equal(a, b):
    for u, v in zip(jax.tree.leaves(a.get_weights()), jax.tree.leaves(b.get_weights())):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("kind, replicas", variants([(k, r) for k in ("iter_dataset", "data_loader") for r in (1, 3, 4)],
                                                    {("iter_dataset", 3), ("data_loader", 4)}))
def test_grain_pipelines_train_evaluate_and_predict_as_the_same_arrays(kind, replicas):
    x, y = common.data(N)
    scale = 2.0 if kind == "iter_dataset" else 1.0
    make = {"iter_dataset": iter_dataset, "data_loader": data_loader}[kind]
    got = common.trainer(ls.MirroredStrategy(replicas))
    got_hist = got.fit(make(CountingSource(x, y)), epochs=2, verbose=0).history
    want = common.trainer(ls.MirroredStrategy(replicas))
    want_hist = want.fit(scale * x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    weights_equal(got, want)  # the same batches, layout and programs: bit for bit
    assert got_hist == want_hist
    assert got.evaluate(make(CountingSource(x, y))) == want.evaluate(scale * x, y, batch_size=B)
    np.testing.assert_array_equal(got.predict(make(CountingSource(x, y))), want.predict(scale * x, batch_size=B))


def test_a_grain_pipeline_with_batch_size_is_refused():
    x, y = common.data(20)
    with pytest.raises(ValueError, match=r"`y`, `sample_weight` and `batch_size` must be None: its batches carry"):
        common.trainer(ls.MirroredStrategy(2)).fit(iter_dataset(CountingSource(x, y)), batch_size=8, verbose=0)


def backup(path, freq=3):
    return ls.callbacks.BackupAndRestore(path, save_freq=freq)


@pytest.mark.filterwarnings("ignore:a pass over the training data ended")  # epochs end with their pass
@crossing
@pytest.mark.parametrize("steps_per_epoch", variants([None, 5], {5}))
def test_a_resume_sets_the_iterator_state_and_reads_nothing_again(steps_per_epoch, tmp_path):
    """7 batches a pass. Stopped at step 8 (backup at 6); the resumed run sets the iterator to the
    backup's state: batches 1..5 of the pass in progress are not read again, and the run ends as
    the uninterrupted one, bit for bit."""
    x, y = common.data(N)
    kw = dict(epochs=3, verbose=0, steps_per_epoch=steps_per_epoch)
    want = common.trainer(ls.MirroredStrategy(3))
    want_hist = want.fit(iter_dataset(CountingSource(x, y)), **kw).history
    with pytest.raises(Stopped):
        common.trainer(ls.MirroredStrategy(3)).fit(iter_dataset(CountingSource(x, y)), callbacks=[
            backup(tmp_path), StopAt(8)], **kw)
    source = CountingSource(x, y)
    got = common.trainer(ls.MirroredStrategy(3))
    first = collections.Counter()

    class Reads(ls.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not first:
                first.update(source.reads)

    got_hist = got.fit(iter_dataset(source), callbacks=[backup(tmp_path), Reads()], **kw).history
    # float32 tolerance: a resumed pass that begins with the short last batch pads it less (per-worker
    # pipelines pad to the largest batch seen), so its sums run in another order
    weights_close(got, want)
    for k, v in want_hist.items():
        np.testing.assert_allclose(got_hist[k], v, rtol=1e-5, atol=1e-6)
    # before the first resumed step: the shape probe (batch 0) and the batch at the position only
    at = 6 if steps_per_epoch else 6 % 7  # the backup's position in its pass
    assert set(first) == set(range(B)) | set(range(at * B, min((at + 1) * B, N)))


def test_the_iterator_states_of_other_workers_are_refused(tmp_path):
    x, y = common.data(N)
    t = common.trainer(ls.MirroredStrategy(2))
    t.fit(iter_dataset(CountingSource(x, y)), epochs=1, steps_per_epoch=2, verbose=0)
    state = t.train_state
    assert state.data.offset == 2 and len(state.data.iterators) == 1
    moved = state.replace(epoch=0, step=1, data=ls.DataPosition(0, 2, None, state.data.iterators * 2))

    class Restore(ls.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.model.restore(moved)

    with pytest.raises(ValueError, match=r"iterator states of 2 workers' pipelines and this job has 1 workers"):
        common.trainer(ls.MirroredStrategy(2)).fit(iter_dataset(CountingSource(x, y)), epochs=1, verbose=0,
                                                   callbacks=[Restore()])


def test_a_pipeline_that_shrank_since_the_backup_is_a_clear_error(tmp_path):
    """The backup's iterator position (row 192) lies past the end of the pipeline given on resume."""
    x, y = common.data(N)
    with pytest.raises(Stopped):
        common.trainer(ls.MirroredStrategy(2)).fit(iter_dataset(CountingSource(x, y)), epochs=2, verbose=0,
                                                   callbacks=[backup(tmp_path), StopAt(8)])
    with pytest.raises(ValueError, match=r"the pipeline's position saved in the backup \(.*192.*\) cannot be set on "
                                         r"this pipeline: IndexError: .* \(did the dataset change since the backup\?\)"):
        common.trainer(ls.MirroredStrategy(2)).fit(iter_dataset(CountingSource(x[:100], y[:100])), epochs=2,
                                                   verbose=0, callbacks=[backup(tmp_path)])


class Unseeded:
    """A re-iterable whose order changes on every pass (a shuffle without a seed)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        order = np.random.default_rng().permutation(len(self.x))
        for lo in range(0, len(order), B):
            yield self.x[order[lo:lo + B]], self.y[order[lo:lo + B]]


@pytest.mark.parametrize("source", ["unseeded", "changed_arrays"])
def test_data_that_differs_on_resume_is_an_error(source, tmp_path):
    x, y = common.data(N)
    data = Unseeded(x, y) if source == "unseeded" else x
    kw = dict(epochs=2, verbose=0) if source == "unseeded" else dict(y=y, batch_size=B, epochs=2, verbose=0)
    with pytest.raises(Stopped):
        common.trainer(ls.MirroredStrategy(2)).fit(data, callbacks=[backup(tmp_path), StopAt(4)], **kw)
    if source == "changed_arrays":
        data = x[::-1].copy()
    with pytest.raises(ValueError, match=r"the training data differs from what was trained on before the backup "
                                         r"\(batch 3 of pass 1"):
        common.trainer(ls.MirroredStrategy(2)).fit(data, callbacks=[backup(tmp_path)], **kw)


@pytest.mark.filterwarnings("ignore:a pass over the training data ended")  # epochs end with their pass
@crossing
def test_a_deterministic_re_iterable_resumes_by_reading_again(tmp_path):
    """A plain iterable of batches (no iterator state) is read again up to the position; the
    checksum of the last batch read again matches, and the run equals the uninterrupted one."""
    x, y = common.data(N)
    batches = [(x[lo:lo + B], y[lo:lo + B]) for lo in range(0, N, B)]
    want = common.trainer(ls.MirroredStrategy(4))
    want.fit(batches, epochs=2, steps_per_epoch=5, verbose=0)
    with pytest.raises(Stopped):
        common.trainer(ls.MirroredStrategy(4)).fit(batches, epochs=2, steps_per_epoch=5, verbose=0,
                                                   callbacks=[backup(tmp_path, 4), StopAt(6)])
    got = common.trainer(ls.MirroredStrategy(2))  # and on another number of replicas
    got.fit(batches, epochs=2, steps_per_epoch=5, verbose=0, callbacks=[backup(tmp_path, 4)])
    weights_close(got, want)


def test_experimental_distribute_dataset_points_grain_datasets_to_the_right_call():
    x, y = common.data(20)
    s = ls.MirroredStrategy(2)
    with pytest.raises(TypeError, match=r"ls.data.IndexedBatches\(dataset, batch_size\)"):
        s.experimental_distribute_dataset(grain.MapDataset.source(CountingSource(x, y)))
    with pytest.raises(TypeError, match="distribute_datasets_from_function"):
        s.experimental_distribute_dataset(iter_dataset(CountingSource(x, y)))


def _launch(workers, tmp_path, mode):
    return launch_workers(WORKERS / "grain_iter_job.py", tmp_path, mode, nproc=workers, failure_timeout=10)


@pytest.mark.xdist_group("processes")
@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.full_suite)])
def test_per_worker_iter_datasets_read_their_shard_and_train_as_one_process(workers, tmp_path):
    proc = _launch(workers, tmp_path, "train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    x, y = common.data(N)
    shards = [np.arange(N)[w::workers] for w in range(workers)]
    local = [[s[lo:lo + 16] for lo in range(0, len(s), 16)] for s in shards]
    steps = max(len(b) for b in local)
    for w in range(workers):
        reads = json.loads((tmp_path / f"reads{w}.json").read_text())
        probe = list(shards[w][:16])  # the shape probe reads the first batch
        assert reads["fit"] == probe + list(shards[w]) * 2, f"worker {w} read other samples than its shard's"
        assert reads["evaluate"] == probe + list(shards[w])
        # stopped at step 5 (backup at 4), resumed from the iterator state: batch 4 (index 3) is not read again
        assert reads["stopped"] == probe + list(np.concatenate(local[w][:5]))
        assert reads["resumed"] == probe + list(np.concatenate(local[w][4:])) + list(shards[w])
    glob = [np.concatenate([local[w][i] for w in range(workers) if i < len(local[w])]) for i in range(steps)]
    ref = common.trainer(ls.MirroredStrategy(workers))
    ref_hist = ref.fit([(2.0 * x[i], y[i]) for i in glob], epochs=2, verbose=0).history
    result = json.loads((tmp_path / "result.json").read_text())
    final = np.load(tmp_path / "final.npz")
    for got in (final["weights"], final["resumed"]):
        np.testing.assert_allclose(got, common.flat(ref.get_weights()), rtol=1e-5, atol=1e-6)
    for k, v in ref_hist.items():
        np.testing.assert_allclose(result["history"][k], v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result["resumed"][k], v, rtol=1e-5, atol=1e-6)
    for k, v in ref.evaluate(2.0 * x, y, batch_size=32).items():
        np.testing.assert_allclose(result["evaluate"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.xdist_group("processes")
def test_unsharded_per_worker_pipelines_are_refused(tmp_path):
    proc = _launch(2, tmp_path, "unsharded")
    assert proc.returncode != 0
    assert "workers 0 and 1 got the same first batch from their per-worker pipelines" in proc.stdout + proc.stderr
