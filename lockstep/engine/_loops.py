"""Loops whose carry starts the same on every replica and comes out different, inside `run`.

Under `shard_map`'s replication typing, a `lax.scan` (or `while_loop`, `fori_loop`) whose initial
carry is replicated — zeros made inside the replica function, as every Keras recurrent layer
makes its initial state — but whose body mixes in the replica's own rows, fails to trace: the
carry's type changes from "replicated" to "per replica". While `run` traces a replica function,
`loops_vary_their_carry` lets such a loop retry once with its initial carry typed per replica
(`lax.pcast(..., to="varying")`): the values are unchanged, and the gradient with respect to a
replicated initial carry is summed over replicas, as for any replicated input of `run`. A loop
that traces as it is never sees the retry.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ._cross_replica import to_varying

_MISMATCH = "carry input and carry output must have equal types"
_state = threading.local()
_lock = threading.Lock()
_users = 0
_originals: dict[str, Callable[..., Any]] = {}


def _retrying(name: str, carry_at: int, carry_kw: str) -> Callable[..., Any]:
    original = _originals[name]

    @functools.wraps(original)
    def loop(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except TypeError as e:
            axis_name = getattr(_state, "active", None)
            if axis_name is None or _MISMATCH not in str(e):
                raise
        vary = functools.partial(to_varying, axis_name=axis_name)
        if len(args) > carry_at:
            args = args[:carry_at] + (jax.tree.map(vary, args[carry_at]),) + args[carry_at + 1:]
        else:
            kwargs[carry_kw] = jax.tree.map(vary, kwargs[carry_kw])
        return original(*args, **kwargs)

    return loop


_LOOPS = {"scan": (1, "init"), "while_loop": (2, "init_val"), "fori_loop": (3, "init_val")}


@contextlib.contextmanager
def loops_vary_their_carry(axis_name: str | tuple[str, ...]) -> Iterator[None]:
    """While tracing a replica function: `jax.lax` loops retry with an initial carry typed as
    varying along the replicas' mesh axis `axis_name`."""
    global _users
    with _lock:
        if _users == 0:
            for name, (at, kw) in _LOOPS.items():
                _originals[name] = getattr(jax.lax, name)
                setattr(jax.lax, name, _retrying(name, at, kw))
        _users += 1
    outer = getattr(_state, "active", None)
    _state.active = axis_name
    try:
        yield
    finally:
        _state.active = outer
        with _lock:
            _users -= 1
            if _users == 0:
                for name, original in _originals.items():
                    setattr(jax.lax, name, original)
                _originals.clear()
