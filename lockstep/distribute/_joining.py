"""How a strategy whose mesh may span several worker processes joins the job's other workers
before it looks at the devices.

`lockstep.cluster` (the coordination service, the watchdog, the workers' agreement on each
compiled program) builds on this package, so it cannot be imported from here: the composition root
(`lockstep/__init__.py`) installs its `join` in `JOIN_HOOKS`. Standard library only, as `_scope`
(`import lockstep` does not import JAX).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``join(cluster_resolver, failure_timeout) -> (cluster, failure_timeout, the workers' agreement or None)``
JOIN_HOOKS: list[Callable[[Any, float | None], tuple[Any, float, Any]]] = []


def join(cluster_resolver: Any, failure_timeout: float | None) -> tuple[Any, float | None, Any]:
    """This process joined to its job's workers (`cluster_resolver`, or the environment's): the
    cluster, the failure timeout and the workers' agreement (`check(description)` of each new
    program, `check_values(what, values)`; None: one worker)."""
    if not JOIN_HOOKS:
        return None, failure_timeout, None
    return JOIN_HOOKS[0](cluster_resolver, failure_timeout)
