"""The coordination service of `jax.distributed` as lockstep uses it: entries keyed by worker
rank under a prefix (``lockstep/done/3``), read back as ``{rank: value}``, and waited for by
polling.

Waiting polls (sleeping between reads) rather than blocking in the runtime, which would hold the
GIL and starve the watchdog that names a dead or frozen peer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any


class Coordination:
    """Entries keyed by rank in the coordination service (the client of `jax.distributed`, or
    any object with its `key_value_*` methods)."""

    def __init__(self, client: Any = None):
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        self._client = client

    def publish(self, prefix: str, rank: int, value: str, overwrite: bool = False) -> None:
        """Sets `prefix` + `rank` to `value`."""
        self._client.key_value_set(f"{prefix}{rank}", value, allow_overwrite=overwrite)

    def delete(self, prefix: str, rank: int) -> None:
        """Removes this worker's entry under `prefix` (one nobody reads any more)."""
        try:
            self._client.key_value_delete(f"{prefix}{rank}")
        except Exception:  # noqa: BLE001 - an entry left behind costs memory only
            pass

    def increment(self, prefix: str, rank: int) -> None:
        """Adds one to the counter `prefix` + `rank`."""
        self._client.key_value_increment(f"{prefix}{rank}", 1)

    def by_rank(self, prefix: str) -> dict[int, str]:
        """Every entry under `prefix`, keyed by the rank its key ends with."""
        return {int(k.rsplit("/", 1)[-1]): v for k, v in self._client.key_value_dir_get(prefix)}

    def wait_for(self, prefix: str, count: int, timeout: float = math.inf, longest: float = 0.05,
                 check: Callable[[dict[int, str]], None] | None = None) -> dict[int, str]:
        """The entries under `prefix` once there are `count` of them, or those there when `timeout`
        seconds have passed. The pause between reads doubles up to `longest`; from then on,
        `check(found)` runs after each read (it may end the wait by raising or exiting)."""
        deadline = time.monotonic() + timeout
        delay = min(0.0005, longest)
        while True:
            found = self.by_rank(prefix)
            if len(found) >= count or time.monotonic() > deadline:
                return found
            if check is not None and delay >= longest:
                check(found)
            time.sleep(delay)
            delay = min(2 * delay, longest)
