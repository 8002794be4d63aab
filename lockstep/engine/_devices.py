"""Simulated CPU devices for tests and demos."""

from __future__ import annotations

import os

import jax

from .._errors import UsageError


def backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def simulate_cpu_devices(n: int) -> None:
    """Makes JAX's CPU backend expose `n` devices, so several replicas run on one CPU.

    Call it before any JAX operation. Calling it again with the number already in
    force is harmless.

    Args:
      n: number of CPU devices, at least 1.

    Raises:
      ValueError: `n` is not a positive integer.
      UsageError: JAX has already started with another number of devices, or `lockstep launch
        --devices-per-proc` started this worker with another number.

    >>> import lockstep as ls, jax
    >>> ls.simulate_cpu_devices(jax.local_device_count())   # already in force: a no-op
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`n` must be a positive integer, got n={n!r}.")
    launched = os.environ.get("LOCKSTEP_DEVICES_PER_PROC")
    if launched and launched != str(n):
        raise UsageError(
            f"simulate_cpu_devices({n}) in a script that `lockstep launch --devices-per-proc {launched}` started: "
            f"each worker gets the launcher's {launched} devices. Drop the call, or make the two numbers agree.")
    if backends_started():
        have = jax.local_device_count("cpu") if jax.default_backend() == "cpu" else None
        if have == n:
            return
        raise UsageError(
            f"simulate_cpu_devices({n}) was called after JAX started (it has {have} CPU "
            "devices). Call it before any JAX operation, right after `import lockstep`, "
            f"or set XLA_FLAGS=--xla_force_host_platform_device_count={n} before Python starts."
        )
    jax.config.update("jax_num_cpu_devices", n)
