"""The runnable examples run and end in agreement with their independent reference."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["custom_loop.py"])
def test_example_runs_and_agrees(script):
    env = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "agree" in proc.stdout.splitlines()[-1]
