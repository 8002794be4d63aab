"""The runnable examples run and end in agreement with their independent reference."""

import os
import pathlib
import subprocess
import sys

import pytest

from launching import CHILD_XLA_FLAGS

# the multi-worker example starts worker processes: with `make test`'s two pytest workers it runs
# in the group of tests that start processes, one after another; the other examples run anywhere
_PROCESSES = pytest.mark.xdist_group("processes")

ROOT = pathlib.Path(__file__).resolve().parents[1]


# make test: the demo and the early-stopping example; make test-full: every example
@pytest.mark.parametrize("script", [pytest.param("custom_loop.py", marks=pytest.mark.full_suite), "keras_mirrored.py",
                                    "early_stopping.py",
                                    pytest.param("f1_training_metric.py", marks=pytest.mark.full_suite), pytest.param("lstm_multi_worker.py", marks=[_PROCESSES, pytest.mark.full_suite]),
                                    # make test covers Grain on several workers in test_grain / test_grain_iter (CI time)
                                    pytest.param("grain_files.py", marks=[_PROCESSES, pytest.mark.full_suite]),
                                    # ResNet50 on 4 replicas is also in test_keras_applications (CI time)
                                    pytest.param("resnet_mirrored.py", marks=pytest.mark.full_suite),
                                    # the transformer on a 2 x 4 mesh is also in test_sharded (CI time)
                                    pytest.param("sharded_transformer.py", marks=pytest.mark.full_suite)])
def test_example_runs_and_agrees(script, tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": CHILD_XLA_FLAGS}
    args = [str(tmp_path)] if script == "keras_mirrored.py" else []
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True,
                          text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "agree" in proc.stdout.splitlines()[-1] and "DISAGREE" not in proc.stdout
