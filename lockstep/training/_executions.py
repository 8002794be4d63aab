"""Executions: several optimizer steps in one compiled call (`steps_per_execution`, Keras' name).

An execution is a list of consecutive updates (`AccumulationGroup`s: one batch each, or the k
batches of gradient accumulation). It splits into *runs* of updates that one program can take
together: batches of one resident pass (`lockstep.engine._resident`: the program gathers their
rows itself), or placed batches of one shape. A run's program is a `lax.scan` over its updates
whose body is exactly the one-step program's: the train step, or the accumulate steps and the
apply step, each batch traced in its own replica context (its mask and count), so the weights,
the metric states and the logs after a run are those of taking its steps one by one.

A run of placed batches that holds a single update takes the one-step path, as without
executions; so does an update whose batches differ in shape, or come from two passes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..data import AccumulationGroup, accumulation_groups
from ..engine import ResidentBatch, gather, get_replica_context, replica_context


def executions(batches: Iterable[Any], accumulation: int, steps_per_execution: int, first_step: int = 0
               ) -> Iterator[tuple[int, list[AccumulationGroup]]]:
    """(the number of its first step, its updates) for each execution of an epoch's `batches`:
    `steps_per_execution` updates of `accumulation` batches (fewer at the epoch's end). Batches are
    read from `batches` only as an execution takes them, so the data's position is the trained one."""
    updates = accumulation_groups(batches, accumulation)
    step = first_step
    while execution := list(itertools.islice(updates, steps_per_execution)):
        yield step, execution
        step += len(execution)


def run_key(update: AccumulationGroup) -> tuple[Any, ...] | None:
    """What updates of one run share (None: this update runs alone, on the one-step path)."""
    batches = update.batches
    first = batches[0]
    if isinstance(first, ResidentBatch):
        if all(isinstance(b, ResidentBatch) and b.pass_ is first.pass_ and b.index == first.index + j
               for j, b in enumerate(batches)):
            return ("resident", first.pass_, len(batches))
        return None
    sig = _signature(first)
    if all(not isinstance(b, ResidentBatch) and _signature(b) == sig for b in batches[1:]):
        return ("placed", sig, len(batches))
    return None


def _signature(batch: Any) -> tuple[Any, ...]:
    return batch.signature


def runs(updates: Sequence[AccumulationGroup]) -> list[tuple[tuple[Any, ...] | None, list[AccumulationGroup]]]:
    """`updates` split into runs of one key (consecutive batches, for a resident pass)."""
    out: list[tuple[tuple[Any, ...] | None, list[AccumulationGroup]]] = []
    for update in updates:
        key = run_key(update)
        if out and key is not None and out[-1][0] == key and (
                key[0] != "resident" or update.batches[0].index == out[-1][1][-1].batches[-1].index + 1):
            out[-1][1].append(update)
        else:
            out.append((key, [update]))
    return out


def placed_feed(updates: Sequence[AccumulationGroup]) -> tuple[Any, Any]:
    """(arguments, kinds) of a run of placed batches: every batch's data, mask and count."""
    batches = [b for u in updates for b in u.batches]
    return ((tuple(b.data for b in batches), tuple(b.mask for b in batches), tuple(b.count for b in batches)),
            ("rows", "rows", "replicated"))


def resident_feed(updates: Sequence[AccumulationGroup], start: jax.Array) -> tuple[Any, Any]:
    """(arguments, kinds) of a run of a resident pass's batches from the one numbered `start`."""
    whole = updates[0].batches[0].pass_
    return (whole.arrays.leaves, whole.table, whole.counts, start), "replicated"


def make_program(steps: dict[str, Callable[..., Any]], length: int, accumulation: int,
                 resident: tuple[Any, int] | None, axis_name: str) -> Callable[..., Any]:
    """A replica function ``(params, opt_state, metric_state, feed) -> (params, opt_state,
    metric_state)`` taking `length` updates of `accumulation` batches each, from a placed feed, or
    from a resident one (`resident`: the structure of the pass's data and its rows per replica)."""
    n = length * accumulation

    def batches_of(feed: Any) -> tuple[Any, Callable[[Any], tuple[Any, Any, Any]]]:
        """Per-batch scan inputs shaped (length, accumulation, ...), and how a replica fetches a batch from one."""
        if resident is None:
            datas, masks, counts = feed
            stacked = (jax.tree.map(lambda *xs: jnp.stack(xs), *datas), jnp.stack(masks), jnp.stack(counts))
            return jax.tree.map(lambda v: v.reshape(length, accumulation, *v.shape[1:]), stacked), lambda x: x
        treedef, per_replica = resident
        leaves, table, counts, start = feed
        xs = (start + jnp.arange(n, dtype=jnp.int32)).reshape(length, accumulation)
        return xs, lambda i: gather(treedef, leaves, table, counts, i, per_replica, axis_name)

    def program(params: Any, opt_state: Any, metric_state: Any, feed: Any) -> Any:
        xs, fetch = batches_of(feed)
        top = get_replica_context()
        assert top is not None

        def one_batch(step: Callable[..., Any], x: Any, *carry: Any) -> Any:
            data, mask, count = fetch(x)
            with replica_context(top.with_batch(mask, count)):
                return step(*carry, data, mask, count), count

        def update(carry: Any, group: Any) -> tuple[Any, None]:
            params, opt_state, metric_state = carry
            if accumulation == 1:
                out, _ = one_batch(steps["train"], jax.tree.map(lambda v: v[0], group), params, opt_state,
                                   metric_state)
                return out, None

            def micro(c: Any, x: Any) -> tuple[Any, Any]:
                p, acc, ms = c
                return one_batch(steps["accumulate"], x, p, opt_state, acc, ms)

            acc = jax.tree.map(jnp.zeros_like, params["trainable"])
            (params, acc, metric_state), counts = jax.lax.scan(micro, (params, acc, metric_state), group)
            params, opt_state, _ = steps["apply"](params, opt_state, acc, jnp.sum(counts))
            return (params, opt_state, metric_state), None

        carry = (params, opt_state, metric_state)
        if length == 1:
            return update(carry, jax.tree.map(lambda v: v[0], xs))[0]
        return jax.lax.scan(update, carry, xs)[0]

    return program
