"""`InFlight`: the bound on compiled programs dispatched ahead of the host (DESIGN.md: more than ~32
collective steps in flight wedge XLA on a multi-device CPU). Each program's outputs give a token,
one small output array; before the host dispatches another past the bound, it waits on the oldest.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import jax

#: Most compiled steps lockstep lets run ahead of the host before it waits on the oldest.
MAX_STEPS_IN_FLIGHT = int(os.environ.get("LOCKSTEP_MAX_STEPS_IN_FLIGHT", "8"))


class InFlight:
    """The tokens of the programs in flight, oldest first. Calls from several threads
    (`strategy.run` in each) share the bound.

    >>> import jax.numpy as jnp
    >>> flight = InFlight()
    >>> out = flight.tracked((jnp.ones(3), jnp.zeros(1)))
    >>> len(flight) <= 1
    True
    """

    def __init__(self) -> None:
        self._tokens: collections.deque[jax.Array] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tokens)

    def tracked(self, out: Any, last_only: bool = False) -> Any:
        """A program's outputs, just dispatched, counted among the steps in flight by the smaller of
        their first and last arrays (a token keeps its array alive: a training step's first is a
        parameter, its last a metric's count; empty arrays are no tokens); by the last alone with
        `last_only` (a program whose next call takes over its first outputs: a deleted token would
        count as finished)."""
        ends = [a for a in (None if last_only else _end_array(out, first=True), _end_array(out, first=False))
                if a is not None and a.size]
        if ends:
            with self._lock:
                self._tokens.append(min(ends, key=lambda a: a.nbytes))
            self.make_room(MAX_STEPS_IN_FLIGHT)
        return out

    def make_room(self, most: int = MAX_STEPS_IN_FLIGHT - 1) -> None:
        """Waits until at most `most` programs are in flight; the tokens of those that have
        finished are let go."""
        with self._lock:
            tokens = self._tokens
            while tokens and _finished(tokens[0]):
                tokens.popleft()
            oldest = [tokens.popleft() for _ in range(len(tokens) - most)]
        for t in oldest:
            if not _finished(t):
                t.block_until_ready()


def _finished(token: jax.Array) -> bool:
    """Whether the program of its output `token` has finished (one deleted or donated since has)."""
    try:
        return token.is_ready()
    except RuntimeError:
        return True


def _end_array(tree: Any, first: bool) -> jax.Array | None:
    """The first (or last) array of a program's outputs (tuples, lists and dicts of arrays; empty
    ones skipped), found without flattening them all: a token that bounds the steps in flight."""
    if isinstance(tree, jax.Array):
        return tree
    items = list(tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (tuple, list)) else ())
    for item in items if first else reversed(items):
        found = _end_array(item, first)
        if found is not None:
            return found
    return None
