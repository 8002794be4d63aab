"""Jobs of several worker processes for the multi-process tests: `launch_workers` runs a script under
`lockstep launch` on 127.0.0.1, bounded in time (the processes are reaped however it ends), and
`rank_results` reads what each rank printed. The worker scripts are files in `tests/workers/`.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

import lockstep as ls

WORKERS = pathlib.Path(__file__).resolve().parent / "workers"
#: XLA_FLAGS of the test processes (the root conftest.py) and their children: programs compiled without
#: LLVM's optimisations (the suite's data are small: compiling is most of its CPU); no simulated devices
CHILD_XLA_FLAGS = "--xla_backend_optimization_level=0"


def launch_command(script, *args, nproc=2, devices=None, failure_timeout=20, max_restarts=0, options=()):
    """The `lockstep launch` command line running `script` with `args` on `nproc` workers."""
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", str(nproc), "--failure-timeout",
           str(failure_timeout), "--max-restarts", str(max_restarts), *options]
    if devices is not None:
        cmd += ["--devices-per-proc", str(devices)]
    return [*cmd, str(script), *map(str, args)]


#: where the worker scripts find the tests' helpers (pytest's `pythonpath` gives the test process the same)
PYTHONPATH = os.pathsep.join([str(WORKERS.parent), str(WORKERS)])


def launch_env(env=None):
    """The workers' environment: this one's, without the 8 simulated devices of the test process,
    with the tests' helpers importable (`PYTHONPATH`)."""
    path = os.pathsep.join(p for p in (PYTHONPATH, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "PYTHONPATH": path, **(env or {})}


def launch_workers(script, *args, nproc=2, devices=None, failure_timeout=20, max_restarts=0, timeout=300, env=None,
                   cwd=None, options=()):
    """Runs `script` on `nproc` workers (`devices` simulated CPU devices each) and returns the
    completed launcher process (its output captured)."""
    cmd = launch_command(script, *args, nproc=nproc, devices=devices, failure_timeout=failure_timeout,
                         max_restarts=max_restarts, options=options)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch_env(env), cwd=cwd)


def output_of(proc):
    """The end of a finished job's output, for assertion messages."""
    return (proc.stdout or "")[-3000:] + (proc.stderr or "")[-3000:]


def rank_results(proc, nproc):
    """Each rank's result: the JSON after ``RESULT `` on the lines the workers printed, one per rank."""
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert len(results) == nproc, output_of(proc)
    return results


# --- runs stopped in the middle, in one process or in the resume job


class Stopped(Exception):
    """What `StopAt` raises."""


class StopAt(ls.callbacks.Callback):
    """Stops the run (as a kill would) once `step` optimizer steps are done: at the end of the
    call that reaches it (several steps a call with `steps_per_execution`)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.global_step >= self.step:
            raise Stopped(self.trainer.global_step)


# --- the resume job (`workers/resume_job.py`): a run killed, preempted or stopped, resumed from its backups
RESUME_JOB = WORKERS / "resume_job.py"


def resume_command(nproc, out_dir, mode, restarts=1):
    return launch_command(RESUME_JOB, out_dir, mode, nproc=nproc, failure_timeout=10, max_restarts=restarts)


def run_resume_job(nproc, out_dir, mode, restarts=1):
    """`workers/resume_job.py` in `mode` (plain, kill, term, es) on `nproc` workers, writing to `out_dir`."""
    return launch_workers(RESUME_JOB, out_dir, mode, nproc=nproc, failure_timeout=10, max_restarts=restarts)


def resume_result(out_dir):
    """The resume job's final weights and history (with `restored_from`, `epoch`)."""
    with open(out_dir / "history.json") as f:
        hist = json.load(f)
    return np.load(out_dir / "final.npz")["weights"], hist


class Uninterrupted(dict):
    """The uninterrupted resume job's result per number of processes, run when first asked for."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self._tmp = tmp_path_factory

    def __missing__(self, nproc):
        d = self._tmp.mktemp(f"plain{nproc}")
        proc = run_resume_job(nproc, d, "plain")
        assert proc.returncode == 0, output_of(proc)
        self[nproc] = resume_result(d)
        return self[nproc]
