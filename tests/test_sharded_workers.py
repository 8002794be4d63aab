"""Sharded models on a mesh spanning two worker processes of two devices each (`ls.ShardedStrategy`
under `lockstep launch`, `tests/workers/sharded_job.py`): Keras code as written equals Keras' own
`fit` on one device, a worker may hold no row, and backups move between one process and two
workers bit for bit; the model ("odd") has widths the meshes' axes do not divide (stored padded,
each mesh its own way)."""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
import numpy as np
import pytest

import lockstep as ls
from keras_reference import assert_equals_one_device, assert_weights_close
from launching import WORKERS, launch_workers, output_of, rank_results
from sharded_cases import (ALL_MODELS, COMPILE, Preempted, StopAfterFirstEpoch, case_data, keras_fit, odd,
                                 sharded_strategy, used_rules)

# these tests start processes: with `make test`'s two pytest workers, they run one after another
pytestmark = pytest.mark.xdist_group("processes")

JOB = WORKERS / "sharded_job.py"


def _run_job(tmp_path, cases):
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = launch_workers(JOB, tmp_path, nproc=2, devices=2, timeout=400)
    assert proc.returncode == 0, output_of(proc)
    return [np.load(tmp_path / f"case{i}.npz") for i in range(len(cases))]


def _keras_reference(name, n, initial=None):
    """Keras' own fit, evaluate and predict on one device (from the weights `initial` if given)."""
    x, y = case_data(name, n=n)
    keras.utils.set_random_seed(1)
    model = ALL_MODELS[name]()
    if initial:
        model.set_weights(initial)
    model.compile(**COMPILE)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return (model.get_weights(), history, model.evaluate(x, y, batch_size=8, verbose=0),
            model.predict(x, batch_size=8, verbose=0))


def _check_fit(tmp_path, i, case, got):
    initial = [got[f"init{j}"] for j in range(sum(k.startswith("init") for k in got.files))]
    assert bool(initial) == case.get("keras_defaults", False)
    weights, history, evaluation, predictions = _keras_reference(case["model"], case.get("n", 37), initial)
    out = json.loads((tmp_path / f"case{i}.json").read_text())
    mine = [got[f"w{j}"] for j in range(len(weights))]
    assert_equals_one_device((mine, out["history"]), (weights, history), rtol=2e-5, atol=5e-6)
    np.testing.assert_allclose(out["evaluate"], evaluation, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got["predictions"], predictions, rtol=2e-5, atol=5e-6)
    for j, w in enumerate(mine):  # model.save, and Keras' ModelCheckpoint (.keras, .weights.h5), from the shards
        for written in "sch":
            np.testing.assert_array_equal(got[f"{written}{j}"], w)


FIT_CASES = [{"model": "odd", "shape": [2, 2], "stage": 3, "mode": "fit"},  # (30, 7) split over model: padded
             # hybrid sharding at Keras' defaults (no seed: each worker draws its own weights, all take worker
             # 0's; verbose=1): a whole copy on each worker, ZeRO over its 2 devices; worker 1 holds no row
             {"model": "mlp", "shape": [2, 2, 1], "stage": 3, "n": 2, "mode": "fit", "keras_defaults": True}]
MORE_FIT_CASES = [{"model": "mlp", "shape": [4, 1], "stage": 2, "n": 1, "mode": "fit"},  # worker 1 holds no row
                  {"model": "cnn", "shape": [4, 1], "stage": 3, "mode": "fit"},
                  {"model": "lstm", "shape": [2, 2], "stage": 1, "mode": "fit"},
                  {"model": "transformer", "shape": [2, 2], "stage": 3, "mode": "fit"},
                  {"model": "cnn", "shape": [2, 2], "stage": 2, "n": 3, "mode": "fit"},
                  {"model": "odd", "shape": [4, 1], "stage": 3, "mode": "fit"},  # ZeRO pads (30, 7) over the workers
                  {"model": "mlp", "shape": [2, 2, 1], "stage": 3, "n": 2, "mode": "fit"}]  # hybrid, seeded


def test_two_workers_equal_keras_own_fit_and_backups_move_between_one_process_and_two_workers(tmp_path):
    x, y = case_data("odd")
    # a backup taken in one process on a (2, 4) mesh at stage 3, cut short after its first epoch
    strategy = sharded_strategy((2, 4), 3, used_rules("odd"))
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = odd()
        model.compile(**COMPILE)
    first = ls.Trainer(model)
    with pytest.raises(Preempted):
        first.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[ls.callbacks.BackupAndRestore(str(tmp_path / "from_one")), StopAfterFirstEpoch()])
    saved = [np.asarray(a) for a in jax.tree.leaves((first.train_state.params, first.train_state.opt_state))]
    assert any(v.padded for v in first.layouts.variables)  # 30 and 7 over 4 model devices

    cases = [*FIT_CASES,
             {"model": "odd", "shape": [2, 2], "stage": 3, "mode": "resume", "backup": str(tmp_path / "from_one")},
             {"model": "odd", "shape": [4, 1], "stage": 1, "mode": "preempt", "backup": str(tmp_path / "from_two")}]
    got = _run_job(tmp_path, cases)
    for i, case in enumerate(FIT_CASES):
        _check_fit(tmp_path, i, case, got[i])

    whole, _ = keras_fit(odd, x, y)  # the uninterrupted run
    at = len(FIT_CASES)  # the resume case
    restored = np.load(tmp_path / f"case{at}_restored.npz")  # the one-process backup, on two workers
    assert len(restored.files) == len(saved)
    for j, a in enumerate(saved):
        np.testing.assert_array_equal(restored[f"arr_{j}"], a)
    assert_weights_close([got[at][f"w{j}"] for j in range(len(whole))], whole, atol=5e-6)

    # the two workers' backup (a (4, 1) mesh at stage 1), resumed in one process on one device
    with ls.OneDeviceStrategy().scope():
        keras.utils.set_random_seed(5)  # other initial weights: the restore must replace them all
        model = odd()
        model.compile(**COMPILE)
    backup = ls.callbacks.BackupAndRestore(str(tmp_path / "from_two"))
    resumed = ls.Trainer(model)
    resumed.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    assert backup.restored_from == 5  # the backup of epoch 1 (5 steps of 8 rows)
    assert_weights_close(resumed.get_weights(), whole, atol=5e-6)


@pytest.mark.full_suite
def test_a_worker_with_no_row_cnn_lstm_and_transformer_on_two_workers_equal_keras_own_fit(tmp_path):
    got = _run_job(tmp_path, MORE_FIT_CASES)
    for i, case in enumerate(MORE_FIT_CASES):
        _check_fit(tmp_path, i, case, got[i])


def test_a_model_built_unseeded_across_workers_is_made_in_its_shards_with_worker_0s_values(tmp_path):
    """Each worker draws its own initialiser seeds; the variables split over the 4 devices of the
    2 workers are made shard by shard with worker 0's seeds (Glorot, orthogonal, constants): no
    whole value on any device, the values worker 0's own initialisers make outside any scope."""
    proc = launch_workers(WORKERS / "sharded_build_job.py", tmp_path, nproc=2, devices=2, timeout=200)
    assert proc.returncode == 0, output_of(proc)
    for result in rank_results(proc, 2):
        assert result["whole"] == [] and result["split"] == 5  # the head's bias (3) stays whole over 4
    built = np.load(tmp_path / "built.npz")
    for i in range(6):
        np.testing.assert_array_equal(built[f"w{i}"], built[f"own{i}"])
