"""`StepRunner`: a `Trainer`'s compiled steps, dispatched on distributed batches.

``state = runner.run(state, updates)`` makes the optimizer updates of one execution, each from a
group of batches (one batch, or k with gradient accumulation), in as few calls of the training
program (`lockstep.training._executions`) as the batches allow; the program is one for every
state layout, replicated or sharded.

Gradient accumulation (``Trainer(..., gradient_accumulation_steps=k)``, Keras' name): `fit` with
``batch_size=b`` makes one update per k batches of b. Each batch adds its gradient of the
*summed* loss to the accumulators; after the group they are summed over replicas and divided once
by the group's real sample count, so the update is one device's step on the k*b samples together
— an epoch's short last group with its own count. Callbacks, `steps_per_epoch`, `global_step` and
`TrainState.step` count updates, so `BackupAndRestore` backups land on update boundaries only (a
run stopped inside a group redoes that group). Logs stay running values over every sample seen.
`BatchNormalization` normalises each batch of b by that batch's own statistics (over all
replicas), as Keras' accumulation does, and its moving averages advance once per batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..data import AccumulationGroup
from ..engine import own_copies
from ._executions import compiled_program, feed_of, make_program, runs
from ._steps import CHECK_VMA, EVAL_KINDS, INFERENCE_OUT_KINDS, PREDICT_KINDS, with_changed
from ._train_state import TrainState


def checked_accumulation(k: Any) -> int:
    """`gradient_accumulation_steps` when it is a positive integer, else a ValueError naming it."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"`gradient_accumulation_steps` must be a positive integer, got gradient_accumulation_steps={k!r}.")
    return k


class StepRunner:
    """Runs `steps` (from `make_steps`) on `engine` (`strategy.extended`) with the state laid out
    by `layout` (`lockstep.sharding.state_layout`'s)."""

    def __init__(self, engine: Any, steps: dict[str, Callable[..., Any]], layout: Any):
        self._engine = engine
        self._steps = steps
        self._layout = layout
        self._programs: dict[tuple[Any, ...], Callable[..., Any]] = {}  # by `feed_of`'s key
        self._starts: dict[int, jax.Array] = {}  # batch numbers on the devices, placed once
        self._calls: dict[tuple[Any, ...], int] = {}  # calls of each program
        self._made: dict[int, weakref.ref[Any]] = {}  # the arrays of the state the last run made, by id

    def run(self, state: TrainState, updates: Sequence[AccumulationGroup],
            keep: Callable[[TrainState], None] | None = None) -> TrainState:
        """`state` after the updates of one execution (the programs take over the buffers of its
        parameters and optimizer state: see `_owned`), each program's given to `keep` as it is made
        (an interrupt after a program took over its state leaves the caller the program's)."""
        state = self._owned(state)
        for key, run in runs(updates):
            feed, program_key = feed_of(run, key, self._start)
            self._calls[program_key] = self._calls.get(program_key, 0) + 1
            program = self._program(program_key)
            state = state.stepped(len(run), *program(state.params, state.opt_state, state.metric_state, feed))
            if keep is not None:
                keep(state)
        self._made = {id(a): weakref.ref(a) for a in jax.tree.leaves((state.params, state.opt_state))}
        return state

    def adopt(self, arrays: Any) -> None:
        """Counts `arrays` (of a state the trainer made itself, whose buffers no one else holds:
        `unshared`) as made by the last run: the next run takes them over without copying them."""
        self._made.update((id(a), weakref.ref(a)) for a in arrays)

    def _owned(self, state: TrainState) -> TrainState:
        """`state` whose parameters and optimizer state the training program may take over (donate):
        the arrays the last run made (no one else holds them but through what `Trainer` lends, which
        it lends anew before a callback runs); any other (a first state made from the model's
        variables, a restored one, what a callback assigned), which may be someone else's (the
        caller of `restore`, a Keras variable), copied first, and so is an array given twice."""
        seen: set[int] = set()
        copied: list[Any] = []

        def foreign(a: Any) -> bool:
            made = self._made.get(id(a))
            if made is not None and made() is a and id(a) not in seen:
                seen.add(id(a))
                return False
            copied.append(a)
            return True
        params, opt_state = own_copies((state.params, state.opt_state), foreign)
        return state.replace(params=params, opt_state=opt_state) if copied else state

    def prepare(self, state: TrainState, updates: Sequence[AccumulationGroup]) -> tuple[Any, ...]:
        """Makes the programs that `run(state, updates)` would call, and runs none; returns the
        first one's key (for `compiled`, which then reads these arguments' shapes)."""
        keys = []
        for key, run in runs(updates):
            feed, program_key = feed_of(run, key, self._start)
            self._calls.setdefault(program_key, 0)
            self._program(program_key).prepare(state.params, state.opt_state, state.metric_state, feed, renew=True)
            keys.append(program_key)
        return keys[0]

    def _program(self, key: tuple[Any, ...]) -> Callable[..., Any]:
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = make_program(self._steps["gradient"], self._layout, self._engine, key)
        return program

    def compiled(self, key: tuple[Any, ...] | None = None) -> tuple[Any, Any, int] | None:
        """The training program `key` (default: the one called most often, the run of a full
        execution's updates), as a jaxpr and as compiled (`compiled_program`), and the updates each
        call takes; None before any is made."""
        if key is None and self._calls:
            key = max(self._calls, key=self._calls.__getitem__)
        made = None if key is None else compiled_program(self._programs[key])
        return None if made is None else (*made, key[-2])

    def _start(self, i: int) -> jax.Array:
        """Batch number `i` as a replicated int32 on the devices (placed once)."""
        start = self._starts.get(i)
        if start is None:
            if len(self._starts) > 65536:
                self._starts.clear()
            start = self._starts[i] = self._engine.distributor.put_copies(np.int32(i))
        return start

    def evaluate(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
        """(the running loss and metric states after `batch`, `params` with the non-trainable state
        the model changed)."""
        state, changed = self._engine.run_arrays(
            self._steps["eval"], (params, state, batch.data, batch.mask, batch.count), EVAL_KINDS, INFERENCE_OUT_KINDS,
            mask=batch.mask, count=batch.count, check_vma=CHECK_VMA)
        return state, with_changed(params, changed)

    def predict(self, params: Any, batch: Any) -> tuple[Any, Any]:
        """(the model's outputs on `batch`'s real rows, on the host; `params` with the non-trainable
        state the model changed)."""
        out, changed = self._engine.run_arrays(
            self._steps["predict"], (params, batch.data, batch.mask, batch.count), PREDICT_KINDS, INFERENCE_OUT_KINDS,
            mask=batch.mask, count=batch.count, check_vma=CHECK_VMA)
        return jax.tree.map(np.asarray, self._engine.real_rows(out, batch.step)), with_changed(params, changed)
