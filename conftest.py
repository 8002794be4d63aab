"""Doctests and tests see Keras on JAX and 8 simulated CPU devices (set before JAX starts), and
XLA compiles their programs without LLVM's optimisations (`launching.CHILD_XLA_FLAGS`, which the
tests' child processes get too: a third less CPU for the suite, whose data are small; the programs,
their HLO passes and so their numbers are the same; benchmarks and `make demo` compile as users do).

Each test process keeps the programs XLA compiled in a folder of its own for the run (JAX's persistent
compilation cache): a program another test compiled, the same HLO for the same devices, is loaded, not
compiled again (a sixth less time for the suite). Its own folder, because JAX writes an entry in place
(a process reading it meanwhile would read part of it); the child processes it starts share another
(worker 0 of a job writes; one that reads an entry being written warns and compiles it). A folder a
killed run left behind is removed by the next run."""

import atexit
import fcntl
import glob
import os
import shutil
import tempfile
import time

from launching import CHILD_XLA_FLAGS  # tests/, on pytest's `pythonpath`

os.environ.setdefault("KERAS_BACKEND", "jax")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CHILD_XLA_FLAGS}".strip()

import lockstep as ls  # noqa: E402

ls.simulate_cpu_devices(8)


def _held(folder: str) -> bool:
    """Whether a live test process holds `folder` (the lock on its ``.lock``, which the kernel
    drops when the process ends, however: a killed run's folder is free; any process namespace)."""
    try:
        fd = os.open(os.path.join(folder, ".lock"), os.O_RDONLY)
    except OSError:  # (none: a folder being made, or made before the locks: held if less than a day old)
        try:
            return time.time() - os.path.getmtime(folder) < 86400
        except OSError:  # (gone meanwhile)
            return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


for _folder in glob.glob(os.path.join(tempfile.gettempdir(), "lockstep-test-programs-*")):
    if not _held(_folder):
        shutil.rmtree(_folder, ignore_errors=True)
_PROGRAMS = tempfile.mkdtemp(prefix="lockstep-test-programs-")
_LOCK = os.open(os.path.join(_PROGRAMS, ".lock.new"), os.O_CREAT | os.O_WRONLY)
fcntl.flock(_LOCK, fcntl.LOCK_EX)  # held until this process ends (named `.lock` once held)
os.rename(os.path.join(_PROGRAMS, ".lock.new"), os.path.join(_PROGRAMS, ".lock"))
atexit.register(shutil.rmtree, _PROGRAMS, ignore_errors=True)  # (not run where the process is killed: `_held`)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_PROGRAMS, "children")  # (the child processes')
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program, however quick to compile
import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.path.join(_PROGRAMS, "tests"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
