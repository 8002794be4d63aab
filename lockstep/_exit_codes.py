"""Exit codes that workers and `lockstep launch` agree on (standard library only: the launcher
imports this module without importing JAX)."""

#: Exit code of a worker that lost a peer (dead, frozen or unreachable).
LOST_WORKER_EXIT_CODE = 75

#: Exit code of a worker that was preempted (SIGTERM) after saving a backup at the agreed step.
PREEMPTED_EXIT_CODE = 83

#: Exit code of worker 0 that could not start the coordinator on the port `lockstep launch` chose
#: (``LOCKSTEP_COORDINATOR_CHOSEN``): another program took it meanwhile; the launcher starts again on another.
PORT_TAKEN_EXIT_CODE = 76
