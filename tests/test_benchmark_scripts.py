"""The benchmark scripts that a GPU run needs stay runnable: `benchmarks/gpu.py --smoke` trains
every system on tiny shapes on CPU and prints its table."""

import os
import pathlib
import subprocess
import sys

from launching import CHILD_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_runs_on_cpu_in_smoke_mode():
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke"], capture_output=True,
                          text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == ["hand-written jax.jit loop", "Keras fit", "lockstep fit (k = 1)",
                                                     "lockstep fit (k = 32)"]
    losses = [float(r.rstrip(" |").rsplit("| ", 1)[1]) for r in rows]
    assert abs(losses[2] - losses[3]) < 1e-3  # k = 32 takes the same steps as k = 1
