"""Doctests and tests see Keras on JAX and 8 simulated CPU devices (set before JAX starts)."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import lockstep as ls  # noqa: E402

ls.simulate_cpu_devices(8)
