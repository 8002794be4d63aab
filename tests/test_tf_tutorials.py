"""TensorFlow's distributed-training tutorials, ported (examples/tf_tutorials/), run on 4 replicas
(the multi-worker one on 2 workers) and held to the same code on one device; the lines changed
beyond the mechanical ones are counted in docs/from-tf-distribute.md's table, which this file checks."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from launching import CHILD_XLA_FLAGS, output_of

pytest.importorskip("tensorflow")
ROOT = pathlib.Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "examples" / "tf_tutorials"
TIMEOUT = 420

# these tests start processes: with `make test`'s two pytest workers, they run one after another
pytestmark = pytest.mark.xdist_group("processes")


def _env(devices, **extra):
    """A TF user's environment (no KERAS_BACKEND: lockstep, imported first, selects JAX) with
    `devices` simulated CPU devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "TF_CONFIG")}
    return {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {CHILD_XLA_FLAGS}", **extra}


def run_tutorial(name, devices, cwd, *args, **env):
    """Runs the ported tutorial `name` on `devices` devices in `cwd`; returns what it wrote."""
    out = pathlib.Path(cwd) / "result.json"
    proc = subprocess.run([sys.executable, str(TUTORIALS / f"{name}.py"), str(out), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=TIMEOUT, env=_env(devices, **env))
    assert proc.returncode == 0, output_of(proc)
    return json.loads(out.read_text()), proc


def free_ports(n):
    """`n` TCP ports on 127.0.0.1 that nothing listens on right now."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in sockets]
    for s in sockets:
        s.close()
    return ports


def marked_lines(name, mark):
    """The lines of a ported tutorial marked `# {mark}` (changed beyond the mechanical changes)."""
    return sum(bool(re.search(rf"(?<!`)# {mark}", line)) for line in (TUTORIALS / f"{name}.py").read_text().splitlines())


def test_the_docs_table_counts_the_lines_each_port_changed():
    table = (ROOT / "docs" / "from-tf-distribute.md").read_text()
    for name in ("keras_tutorial", "custom_training", "multi_worker_with_keras", "input_tutorial",
                 "distributed_training_guide", "multi_worker_with_ctl", "save_and_load"):
        row = re.search(rf"\| `{name}\.py` \| \d+ \| \d+ \| (\d+) \| (\d+) \|", table)
        assert row is not None, name
        marks = (marked_lines(name, "jax-step"), marked_lines(name, "other:"))
        assert (int(row.group(1)), int(row.group(2))) == marks, name


@pytest.mark.full_suite
def test_the_keras_tutorial_on_4_replicas_equals_one_device(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    four, proc = run_tutorial("keras_tutorial", 4, tmp_path / "a")
    assert "Number of devices: 4" in proc.stdout
    one, _ = run_tutorial("keras_tutorial", 1, tmp_path / "b")
    for k in one["history"]:
        np.testing.assert_allclose(four["history"][k], one["history"][k], rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(four["evaluate"], one["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(four["replicated"], one["evaluate"], rtol=1e-5)
    assert four["checkpoints"] == one["checkpoints"] == 12


def test_the_custom_training_tutorial_on_4_replicas_equals_one_device(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    four, proc = run_tutorial("custom_training", 4, tmp_path / "a")
    assert "Number of devices: 4" in proc.stdout
    one, _ = run_tutorial("custom_training", 1, tmp_path / "b")
    # per epoch: train loss (the tutorial's mean of batch losses), train accuracy, test loss, test accuracy
    np.testing.assert_allclose(four["epochs"], one["epochs"], rtol=1e-5, atol=1e-6)
    assert four["restored_accuracy"] == one["restored_accuracy"]


def _tf_config_job(script, workers, where, *args, **env):
    """`script` run by `workers` processes, each with its TF_CONFIG (as TF's tutorials start them);
    what each wrote to ``where/result.json.<worker>``."""
    ports = free_ports(workers)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [subprocess.Popen(
        [sys.executable, str(TUTORIALS / f"{script}.py"), str(where / "result.json"), *map(str, args)], cwd=where,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(1, TUTORIAL_STEPS="8", LOCKSTEP_FAILURE_TIMEOUT="20", **env,
                 TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})))
        for i in range(workers)]
    try:
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    return [json.loads((where / f"result.json.{i}").read_text()) for i in range(workers)]


@pytest.mark.full_suite
def test_the_multi_worker_keras_tutorial_on_2_workers_equals_one_worker(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    two = _tf_config_job("multi_worker_with_keras", 2, tmp_path / "a", tmp_path / "a" / "keras-model.keras")
    one = _tf_config_job("multi_worker_with_keras", 1, tmp_path / "b", tmp_path / "b" / "keras-model.keras")[0]
    assert [r["task"] for r in two] == [["worker", 0], ["worker", 1]]
    for r in two:
        assert r["loaded_equal"]
        for k in one["history"]:
            np.testing.assert_allclose(r["history"][k], one["history"][k], rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_allclose(r["backed_up"][k], one["backed_up"][k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert not (tmp_path / "a" / "workertemp_1").exists()  # the tutorial's own clean-up of worker 1's copy


@pytest.mark.full_suite
def test_the_multi_worker_custom_loop_tutorial_on_2_workers_equals_one_worker(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    two = _tf_config_job("multi_worker_with_ctl", 2, tmp_path / "a")
    one = _tf_config_job("multi_worker_with_ctl", 1, tmp_path / "b")[0]
    for r in two:  # per epoch: the Keras metric updated inside `run`, the mean of the step losses
        np.testing.assert_allclose(r, one, rtol=1e-5, atol=1e-6)
    assert (tmp_path / "a" / "ckpt" / "ckpt.npz").exists()  # worker 0's; worker 1 removed its own copy
    assert not (tmp_path / "a" / "workertemp_1" / "ckpt").exists()


def test_the_input_tutorial_gives_tf_s_values(tmp_path):
    """The input tutorial on its 2 devices: what its cells print is what TF documents (NumPy here)."""
    printed, _ = run_tutorial("input_tutorial", 2, tmp_path)
    plain = printed[:7]  # `train_step` on the undistributed batches: 6 of 16 rows, then 4
    assert [np.shape(p[0]) for p in plain] == [(16, 1)] * 6 + [(4, 1)]
    np.testing.assert_allclose(np.concatenate([p[0] for p in plain]), np.full((100, 1), 0.7), rtol=1e-6)
    losses = [p for p in printed if p and p[0] == "Loss is "]
    assert len(losses) == 7 + 10 * 5  # one pass over the dataset, then 10 epochs of 5 steps
    assert sum(len(r) for r in losses[6][1]) == 4  # the short last batch: its 4 real rows only
    at = printed.index([[[0, 1], [2, 3]]])  # `get_next_as_optional` over range(9) in batches of 4
    assert printed[at:at + 3] == [[[[0, 1], [2, 3]]], [[[4, 5], [6, 7]]], [[[8], []]]]
    lookups = printed[at + 3 + 25:at + 3 + 25 + 3]  # StringLookup of "a", "c", "e", ... per replica (batches of 2)
    assert lookups == [[[[1, 3], [0, 1]]], [[[3, 0], [1, 3]]], [[[0, 1], [3, 0]]]]
    assert printed[at + 31] == [[[i, 2 * i] for i in range(24)]]  # predict's outputs by index
    assert printed[at + 32:] == [[[0, 1]]] * 4  # experimental_distribute_values_from_function


@pytest.mark.full_suite
def test_the_distributed_training_guide_on_4_replicas_equals_one_device(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    four, _ = run_tutorial("distributed_training_guide", 4, tmp_path / "a")
    one, _ = run_tutorial("distributed_training_guide", 1, tmp_path / "b")
    assert (four["replicas"], one["replicas"], four["reduce"]) == (4, 1, 1.0)
    for k in ("fit_dataset", "fit_arrays"):
        for name in one[k]:
            np.testing.assert_allclose(four[k][name], one[k][name], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(four["evaluate"], one["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(four["custom_loop"], one["custom_loop"], rtol=1e-5)  # 60 steps of the custom loop


@pytest.mark.full_suite
def test_the_save_and_load_tutorial_on_4_replicas_equals_one_device(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    four, _ = run_tutorial("save_and_load", 4, tmp_path / "a")
    one, _ = run_tutorial("save_and_load", 1, tmp_path / "b")
    assert (four["replicas"], one["replicas"]) == (4, 1)
    for k in ("fit", "restored", "restored_ds"):  # the reloaded model outside any scope, and in a OneDeviceStrategy's
        for name in one[k]:
            np.testing.assert_allclose(four[k][name], one[k][name], rtol=1e-5, err_msg=f"{k} {name}")
