"""The benchmark scripts that a GPU run needs stay runnable: `benchmarks/gpu.py --smoke` trains
every system on tiny shapes on CPU and prints its tables."""

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
    tables = [[line.strip("| ").split(" | ") for line in block.splitlines()[2:]]
              for block in proc.stdout.split("\n\n") if block.startswith("| system |")]
    speed, own = tables
    assert [r[0] for r in speed] == ["hand-written jax.jit loop", "Keras fit", "lockstep fit (k = 1)",
                                     "lockstep fit (k = 32)"]
    losses = [float(r[5]) for r in speed]
    assert abs(losses[2] - losses[3]) < 1e-3  # k = 32 takes the same steps as k = 1
    flops = [float(r[1]) for r in own]  # Goodput's count of a step, the same with 1 step a call and with 32
    assert flops[0] > 0 and flops[0] == flops[1]


def test_the_backup_benchmark_runs_its_gpu_model_on_cpu_in_quick_mode(tmp_path):
    """`backups.py --gpu` (the transformer of gpu.py) times a write and the steps that overlap it."""
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "BACKUPS_GPU.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "backups.py"), "--gpu", "--quick", "--modes",
                           "async", "--out", str(out)], capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r[0]: r for r in (line.strip("| ").split(" | ") for line in out.read_text().splitlines()
                              if line.startswith("| ") and not line.startswith("| backups"))}
    none, background = rows["none"], rows["in the background (`async_save=True`, default)"]
    assert none[-1] == "-" and float(none[-2]) == 0.0  # no backup: no write, no step during one
    assert float(background[-2]) > 0 and float(background[-1].split()[0]) > 0
