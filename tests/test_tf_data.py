"""tf.data input (the `tf` extra): a dataset of global batches split by rows, each worker
converting only its own; the same numbers as the same arrays; unseeded pipelines are errors."""

import json

import jax
import numpy as np
import pytest

import lockstep as ls

tf = pytest.importorskip("tensorflow")  # `pip install lockstep[tf]`; `make test` installs it

import common  # noqa: E402
from launching import WORKERS, StopAt, Stopped, launch_workers  # noqa: E402
from suite import variants  # noqa: E402

N, B = 203, 32


def dataset(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 2.0, b)).batch(B)


@pytest.mark.parametrize("replicas", variants([1, 3, 4], {3}))
def test_a_tf_dataset_trains_evaluates_and_predicts_as_the_same_arrays(replicas):
    x, y = common.data(N)
    got = common.trainer(ls.MirroredStrategy(replicas))
    got_hist = got.fit(dataset(x, y), epochs=2, verbose=0).history
    want = common.trainer(ls.MirroredStrategy(replicas))
    want_hist = want.fit(2.0 * x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    for a, b in zip(jax.tree.leaves(got.get_weights()), jax.tree.leaves(want.get_weights())):
        np.testing.assert_array_equal(a, b)  # the same batches, layout and programs: bit for bit
    assert got_hist == want_hist
    assert got.evaluate(dataset(x, y)) == want.evaluate(2.0 * x, y, batch_size=B)
    np.testing.assert_array_equal(got.predict(dataset(x, y).map(lambda a, b: a)), want.predict(2.0 * x, batch_size=B))


def test_each_replica_gets_its_rows_of_each_global_batch():
    s = ls.MirroredStrategy(4)
    ds = tf.data.Dataset.range(10).batch(7)
    got = [np.asarray(b.data).reshape(4, -1).tolist() for b in s.experimental_distribute_dataset(ds)]
    assert [b.num_real for b in s.experimental_distribute_dataset(ds)] == [7, 3]
    real = [[r[:k] for r, k in zip(step, counts)] for step, counts in zip(got, [[2, 2, 2, 1], [2, 1, 0, 0]])]
    assert real == [[[0, 1], [2, 3], [4, 5], [6]], [[7, 8], [9], [], []]]


def test_a_tf_dataset_with_batch_size_is_refused():
    x, y = common.data(20)
    with pytest.raises(ValueError, match=r"tf.data dataset, `y`, `sample_weight` and `batch_size` must be None"):
        common.trainer(ls.MirroredStrategy(2)).fit(dataset(x, y), batch_size=8, verbose=0)


@pytest.mark.parametrize("seeded", variants([True, False], {True}))
def test_a_resumed_tf_pipeline_must_give_the_same_data(seeded, tmp_path):
    """A seeded shuffle resumes exactly (the consumed batches are read again, the last one checked);
    an unseeded one gives another order, which the check names."""
    x, y = common.data(N)

    def shuffled():
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shuffle(N, seed=7 if seeded else None, reshuffle_each_iteration=False).batch(B)

    want = common.trainer(ls.MirroredStrategy(2))
    want.fit(shuffled(), epochs=1, verbose=0)
    with pytest.raises(Stopped):
        common.trainer(ls.MirroredStrategy(2)).fit(shuffled(), epochs=1, verbose=0, callbacks=[
            ls.callbacks.BackupAndRestore(tmp_path, save_freq=4), StopAt(5)])
    got = common.trainer(ls.MirroredStrategy(2))
    if not seeded:
        with pytest.raises(ValueError, match="the training data differs from what was trained on before the backup"):
            got.fit(shuffled(), epochs=1, verbose=0, callbacks=[ls.callbacks.BackupAndRestore(tmp_path)])
        return
    got.fit(shuffled(), epochs=1, verbose=0, callbacks=[ls.callbacks.BackupAndRestore(tmp_path)])
    for a, b in zip(jax.tree.leaves(got.get_weights()), jax.tree.leaves(want.get_weights())):
        np.testing.assert_array_equal(a, b)


@pytest.mark.xdist_group("processes")
# make test: tf.data in one process above; per-worker pipelines on 2 workers in test_grain_iter (CI time)
@pytest.mark.parametrize("mode", variants(["seeded", "unseeded"], set()))
def test_two_workers_split_a_tf_dataset_by_rows(mode, tmp_path):
    proc = launch_workers(WORKERS / "tf_data_job.py", tmp_path, mode, failure_timeout=10)
    if mode == "unseeded":
        assert proc.returncode != 0
        assert "the workers' tf.data pipelines gave different first batches" in proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    x, y = common.data(N)
    result = json.loads((tmp_path / "result.json").read_text())
    order = np.asarray(result["order"])  # the workers' shuffle (TF's seeds: the global one is per process)
    assert sorted(order) == list(range(N))
    ref = common.trainer(ls.MirroredStrategy(2))
    ref_hist = ref.fit(2.0 * x[order], y[order], batch_size=B, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(np.load(tmp_path / "final.npz")["weights"], common.flat(ref.get_weights()),
                               rtol=1e-5, atol=1e-6)
    for k, v in ref_hist.items():
        np.testing.assert_allclose(result["history"][k], v, rtol=1e-5, atol=1e-6)
    for k, v in ref.evaluate(2.0 * x, y, batch_size=B).items():
        np.testing.assert_allclose(result["evaluate"][k], v, rtol=1e-5, atol=1e-6)
    # each worker converted only its replica's rows of each global batch (worker 1 holds none of the
    # last batch's 11 rows: it reads none of them, only one row for the shapes of its padding)
    want = {0: [[0, 16]] * 6 + [[0, 11]], 1: [[16, 32]] * 6}
    for w in range(2):
        assert json.loads((tmp_path / f"rows{w}.json").read_text()) == want[w] * 2
