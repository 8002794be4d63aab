"""Exit codes that workers and `lockstep launch` agree on (standard library only: the launcher
imports this module without importing JAX)."""

#: Exit code of a worker that lost a peer (dead, frozen or unreachable).
LOST_WORKER_EXIT_CODE = 75

#: Exit code of a worker that was preempted (SIGTERM) after saving a backup at the agreed step.
PREEMPTED_EXIT_CODE = 83
