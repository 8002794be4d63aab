"""Doctests and tests see Keras on JAX and 8 simulated CPU devices (set before JAX starts), and
XLA compiles their programs without LLVM's optimisations (`launching.CHILD_XLA_FLAGS`, which the
tests' child processes get too: a third less CPU for the suite, whose data are small; the programs,
their HLO passes and so their numbers are the same; benchmarks and `make demo` compile as users do)."""

import os

from launching import CHILD_XLA_FLAGS  # tests/, on pytest's `pythonpath`

os.environ.setdefault("KERAS_BACKEND", "jax")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CHILD_XLA_FLAGS}".strip()

import lockstep as ls  # noqa: E402

ls.simulate_cpu_devices(8)
