"""The training program: optimizer updates in one compiled call, the same for every state layout.

An execution (`steps_per_execution`, Keras' name) is a list of consecutive updates
(`AccumulationGroup`s: one batch each, or the k batches of gradient accumulation). It splits into
*runs* of updates that one program takes together (`runs`): batches of one resident pass
(`lockstep.engine._resident`: the program takes their rows itself), or placed batches of one
shape; an update whose batches differ in shape, or come from two passes, is a run of its own.

A run's program (`make_program`) is one `jax.jit` made from the gradient step and the state
layout (`lockstep.sharding.state_layout`), and nothing else; it donates the parameters' and the
optimizer state's buffers, so a step's new state takes their memory (one copy of the state on a
device, not two: `StepRunner` gives it only arrays no one else holds):

* the replicas' part, a `shard_map` over the batch axis: each replica takes the update's batches
  one after another (`micro_batched`: a `lax.scan` over them, or one call for one batch), each in
  its own replica context (its mask and count), and returns its share of their gradient reduced
  as the layout says (`layout.reduce`: an all-reduce for whole variables, a reduce-scatter along a
  ZeRO dimension), the agreed non-trainable state and the logs;
* the update (`layout.update`): inside it where the layout keeps every variable whole
  (`update_in_replica`: each replica updates its copy, one fusion region with the gradient; with
  the update outside, a one-device CNN at batch 16 ran 0.65-0.95x as fast in some fresh processes),
  else outside it, on the arrays as the layout lays them out (the compiler partitions it);
* for several updates, a `lax.scan` over both.

With gradient accumulation each batch adds its gradient of the *summed* loss (its mean-loss
gradient times its real count) to the accumulators, which the layout reduces once after the last
batch (or per batch, where it keeps each replica's share: ZeRO stages 2 and 3), divided once by the
group's real count. So the weights, the metric states and the logs after a run are those of
taking its steps one by one, on any layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..data import AccumulationGroup, accumulation_groups
from ..engine import ResidentBatch, get_replica_context, replica_context, take_step
from ._precision import loss_scale_of
from ._steps import CHECK_VMA


def calls(items: Iterable[Any], steps_per_execution: int, first: int = 0) -> Iterator[tuple[int, list[Any]]]:
    """(the number of its first item, its items) for each call of `steps_per_execution` of `items`
    (fewer at their end), numbered from `first`; items are read only as a call takes them.

    >>> list(calls("abcde", 2))
    [(0, ['a', 'b']), (2, ['c', 'd']), (4, ['e'])]
    """
    items = iter(items)
    while group := list(itertools.islice(items, steps_per_execution)):
        yield first, group
        first += len(group)


def whole_calls(steps: int | None, steps_per_execution: int) -> int | None:
    """`steps` as Keras' loops run them: whole calls of `steps_per_execution`, so 5 at 3 a call
    are 6 (fewer only where the data ends first); None: to the data's end.

    >>> whole_calls(5, 3), whole_calls(6, 3), whole_calls(None, 3)
    (6, 6, None)
    """
    return -(-steps // steps_per_execution) * steps_per_execution if steps else steps


def executions(batches: Iterable[Any], accumulation: int, steps_per_execution: int, first_step: int = 0
               ) -> Iterator[tuple[int, list[AccumulationGroup]]]:
    """(the number of its first step, its updates) for each execution of an epoch's `batches`:
    `steps_per_execution` updates of `accumulation` batches (fewer at the epoch's end). Batches are
    read from `batches` only as an execution takes them, so the data's position is the trained one."""
    return calls(accumulation_groups(batches, accumulation), steps_per_execution, first_step)


def run_key(update: AccumulationGroup) -> tuple[Any, ...] | None:
    """What updates of one run share (None: this update runs alone, its batches placed and unrolled)."""
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


def feed_of(run: Sequence[AccumulationGroup], key: tuple[Any, ...] | None, start: Callable[[int], jax.Array]
            ) -> tuple[Any, Any]:
    """(what the program of `run` reads its batches from, the program's key): a resident pass's
    rows (each replica's share), real counts and first batch number (`start(i)`: batch number i on the devices), or
    every batch's data, mask and count (placed from the host where a batch is resident but the run
    is not a resident one)."""
    if key is not None and key[0] == "resident":
        whole = run[0].batches[0].pass_
        feed = (whole.leaves, whole.counts, whole.table, start(run[0].batches[0].index))
        return feed, ("resident", whole.treedef, whole.per_replica, len(run), key[2])
    batches = [b.placed() if isinstance(b, ResidentBatch) else b for u in run for b in u.batches]
    feed = (tuple(b.data for b in batches), tuple(b.mask for b in batches), tuple(b.count for b in batches))
    return feed, ("stacked" if key is not None and len(batches) > 1 else "placed", len(run), len(run[0].batches))


def make_program(gradient_step: Callable[..., Any], layout: Any, engine: Any, key: tuple[Any, ...]
                 ) -> Callable[..., Any]:
    """``(params, opt_state, metric_state, feed) -> (params, opt_state, metric_state)``, compiled:
    the updates of one run (`feed_of`'s feed and key) taken by `gradient_step` (`make_gradient_step`'s)
    and `layout` (see the module doc)."""
    kind, *rest = key
    length, accumulation = rest[-2:]
    axis = engine.batch_axis
    if kind == "resident":
        treedef, per_replica = rest[:2]
        source_kinds, xs_kinds = ("rows", "replicated", "replicated"), "replicated"

        def fetch(source: Any, i: jax.Array) -> tuple[Any, Any, Any]:
            return take_step(treedef, *source, i, per_replica, axis)
    else:
        source_kinds = "replicated"
        xs_kinds = (P(None, axis), P(None, axis), "replicated") if kind == "stacked" else ("rows", "rows", "replicated")

        def fetch(source: Any, batch: Any) -> tuple[Any, Any, Any]:
            return batch
    replica = micro_batched(gradient_step, layout, fetch, accumulation, stacked=kind != "placed")

    def updated(grads: Any, non_trainable: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        trainable, opt_state = layout.update(grads, opt_state, params["trainable"])
        return {"trainable": trainable, "non_trainable": non_trainable}, opt_state

    if layout.update_in_replica:  # every variable whole: each replica updates its copy, as one device would
        def replica_update(params: Any, opt_state: Any, metric_state: Any, source: Any, xs: Any) -> Any:
            grads, non_trainable, metric_state = replica(params, loss_scale_of(opt_state), metric_state, source, xs)
            return (*updated(grads, non_trainable, opt_state, params), metric_state)
        whole = engine.mapped(replica_update, ("replicated", "replicated", "per_replica", source_kinds, xs_kinds),
                              ("replicated", "replicated", "per_replica"), check_vma=CHECK_VMA, with_batch=False)

        def update(carry: Any, xs: Any, source: Any) -> Any:
            return whole(*carry, source, xs)
    else:  # the update outside the replicas, on the arrays where the layout lays them (the compiler partitions it)
        replicas = engine.mapped(replica, ("replicated", "replicated", "per_replica", source_kinds, xs_kinds),
                                 (layout.gradient_kinds, "replicated", "per_replica"), check_vma=CHECK_VMA,
                                 with_batch=False)

        def update(carry: Any, xs: Any, source: Any) -> Any:
            params, opt_state, metric_state = carry
            grads, non_trainable, metric_state = replicas(params, loss_scale_of(opt_state), metric_state, source, xs)
            return (*updated(grads, non_trainable, opt_state, params), metric_state)

    def program(params: Any, opt_state: Any, metric_state: Any, feed: Any) -> Any:
        carry = (params, opt_state, metric_state)
        if kind == "resident":
            source, start = feed[:-1], feed[-1]
            xs = (start + jnp.arange(length * accumulation, dtype=jnp.int32)).reshape(length, accumulation)
        elif kind == "stacked":
            source = None
            datas, masks, counts = feed
            stacked = (jax.tree.map(lambda *v: jnp.stack(v), *datas), jnp.stack(masks), jnp.stack(counts))
            xs = jax.tree.map(lambda v: v.reshape(length, accumulation, *v.shape[1:]), stacked)
        else:
            return update(carry, feed, None)
        if length == 1:
            return update(carry, jax.tree.map(lambda v: v[0], xs), source)
        return jax.lax.scan(lambda c, x: (update(c, x, source), None), carry, xs)[0]

    out_shardings: dict[Any, Any] = {}

    def prepare(params: Any, opt_state: Any, metric_state: Any, feed: Any, renew: bool = False) -> Any:
        """The program for these arguments (`signature`: the first's shapes, or these with `renew`)."""
        structure = jax.tree.structure(opt_state)
        if (compiled := out_shardings.get(structure)) is None:
            compiled = out_shardings[structure] = engine.jit(program, layout.out_shardings(params, opt_state),
                                                             donate_argnums=(0, 1))  # the state's buffers reused
        if renew or getattr(call, "signature", (None,))[0] is not compiled:
            call.signature = (compiled, jax.tree.map(  # type: ignore[attr-defined]
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                (params, opt_state, metric_state, feed)))
        return compiled

    def call(params: Any, opt_state: Any, metric_state: Any, feed: Any) -> Any:
        return prepare(params, opt_state, metric_state, feed)(params, opt_state, metric_state, feed)
    call.prepare = prepare  # type: ignore[attr-defined]
    call.replica = replica  # type: ignore[attr-defined]  # (what one replica runs, for tests that read its trace)
    return call


def compiled_program(call: Callable[..., Any]) -> tuple[Any, Any] | None:
    """The program of `make_program` as a jaxpr and as XLA compiled it, for the argument shapes
    of its `signature` (`matmul_flops`; `memory_analysis()`), or None before it is first made."""
    signature = getattr(call, "signature", None)
    if signature is None:
        return None
    executable = getattr(call, "executable", None)
    if executable is None or executable[0] is not signature:  # traced once (Goodput asks every epoch)
        compiled, args = signature
        traced = compiled.trace(*args)
        executable = call.executable = (signature, traced.jaxpr, traced.lower().compile())  # type: ignore[attr-defined]
    return executable[1], executable[2]


def micro_batched(gradient_step: Callable[..., Any], layout: Any, fetch: Callable[[Any, Any], Any],
                  accumulation: int, stacked: bool) -> Callable[..., Any]:
    """A replica's ``(params, loss_scale, metric_state, source, xs) -> (grads, non_trainable,
    metric_state)`` for one update of `accumulation` batches (`xs`: stacked along a first axis, or
    tuples of their data, masks and counts; `fetch(source, x)` gives one's data, mask and count):
    levanter's `microbatched`, with the layout's reduction (see the module doc)."""
    top: list[Any] = []

    def one_batch(carry: Any, x: Any, source: Any, scale: Any) -> tuple[Any, Any]:
        params, acc, metric_state = carry
        data, mask, count = fetch(source, x)
        with replica_context(top[0].with_batch(mask, count)):
            grads, non_trainable, metric_state = gradient_step(params, scale, metric_state, data, mask, count)
        params = {"trainable": params["trainable"], "non_trainable": non_trainable}
        if accumulation == 1:
            return (params, layout.reduce(grads), metric_state), count
        summed = jax.tree.map(lambda g: g * count, grads)
        if layout.shards_accumulators:
            summed = layout.reduce(summed)
        return (params, jax.tree.map(jnp.add, acc, summed), metric_state), count

    def replica(params: Any, scale: Any, metric_state: Any, source: Any, xs: Any) -> Any:
        top[:] = [get_replica_context()]
        if accumulation == 1:
            x = jax.tree.map(lambda v: v[0], xs) if stacked else tuple(part[0] for part in xs)
            (params, grads, metric_state), _ = one_batch((params, None, metric_state), x, source, scale)
            return grads, params["non_trainable"], metric_state
        whole = layout.reduce if layout.shards_accumulators else (lambda t: t)
        shapes = replica.accumulators = jax.eval_shape(whole, params["trainable"])  # type: ignore[attr-defined]
        acc = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        carry = (params, acc, metric_state)
        if stacked:
            carry, counts = jax.lax.scan(lambda c, x: one_batch(c, x, source, scale), carry, xs)
            total = jnp.sum(counts)
        else:
            total = 0.0
            for x in zip(*xs):
                carry, count = one_batch(carry, x, source, scale)
                total = total + count
        params, acc, metric_state = carry
        if not layout.shards_accumulators:
            acc = layout.reduce(acc)
        return jax.tree.map(lambda a: a / total, acc), params["non_trainable"], metric_state
    return replica
