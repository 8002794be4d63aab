"""Exceptions raised by lockstep."""


class UsageError(RuntimeError):
    """A lockstep call made in the wrong order or the wrong place.

    For example: `simulate_cpu_devices` after JAX has started, or the eager
    metric face (`update_state`) inside `strategy.run`.
    """


class WorkersDisagreeError(UsageError):
    """The workers of a multi-worker job are about to run different compiled programs (say, one
    calls `fit` while another calls `evaluate`, or their batches have different shapes)."""
