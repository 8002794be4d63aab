"""`StepRunner`: a `Trainer`'s compiled steps, dispatched on distributed batches.

It owns the steps (`_steps`), the kinds of their arguments, and the per-replica gradient
accumulators: ``state = runner.step(state, group)`` makes one optimizer update from a group of batches — one train step, or,
with gradient accumulation, one accumulate step per batch and one apply step.

Gradient accumulation (``Trainer(..., gradient_accumulation_steps=k)``, Keras' name): `fit` with
``batch_size=b`` makes one update per k batches of b. Each batch adds its gradient of the
*summed* loss to per-replica accumulators (no collective); the apply step sums them over replicas
and divides once by the group's real sample count, so the update is one device's step on the
k*b samples together — an epoch's short last group with its own count. Callbacks,
`steps_per_epoch`, `global_step` and `TrainState.step` count updates, so `BackupAndRestore`
backups land on update boundaries only (a run stopped inside a group redoes that group). Logs
stay running values over every sample seen. `BatchNormalization` normalises each batch of b by
that batch's own statistics (over all replicas), as Keras' accumulation does, and its moving
averages advance once per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..data import AccumulationGroup
from ..engine import ResidentBatch
from ._executions import make_program, placed_feed, resident_feed, runs
from ._train_state import TrainState
from ._steps import (
    ACCUMULATE_KINDS,
    ACCUMULATE_OUT,
    APPLY_KINDS,
    APPLY_OUT,
    CHECK_VMA,
    EVAL_KINDS,
    PREDICT_KINDS,
    TRAIN_KINDS,
    TRAIN_OUT,
)


def checked_accumulation(k: Any) -> int:
    """`gradient_accumulation_steps` when it is a positive integer, else a ValueError naming it."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"`gradient_accumulation_steps` must be a positive integer, got gradient_accumulation_steps={k!r}.")
    return k


class StepRunner:
    """Runs `steps` (from `make_steps`) on `engine` (`strategy.extended`), `accumulation` batches
    per optimizer update."""

    def __init__(self, engine: Any, steps: dict[str, Callable[..., Any]], accumulation: int, placement: Any = None):
        self._engine = engine
        self._steps = steps
        self._accumulation = accumulation
        self._sharded = placement if placement is not None and placement.plan is not None else None
        self._train = self._apply = self._accumulate = None  # a sharded model's own programs (`_placement`):
        if self._sharded is not None:
            self._train, self._apply = self._sharded.train_program(steps["gradient"]), self._sharded.apply_program()
            self._accumulate = self._sharded.accumulate_program(steps)
        self._acc: Any = None  # per-replica gradient sums of the group in progress
        self._programs: dict[tuple[Any, ...], Callable[..., Any]] = {}  # several updates in one program
        self._starts: dict[int, jax.Array] = {}  # batch numbers on the devices, placed once

    def start(self, params: Any) -> None:
        """Fresh (zero) accumulators for a `fit` on `params`: a `fit` interrupted mid-group leaves none behind."""
        if self._accumulation > 1 and self._sharded is not None and self._sharded.shards_accumulators:
            self._acc = self._sharded.zero_accumulators(params)  # stages 2 and 3: each replica accumulates its share
            return
        self._acc = None if self._accumulation == 1 else self._engine.per_replica_copies(
            jax.tree.map(lambda p: np.zeros(p.shape, p.dtype), params["trainable"]))

    def step(self, state: TrainState, group: AccumulationGroup) -> TrainState:
        """`state` after one optimizer update from `group`'s batches (one more step taken)."""
        run = self._engine.run_arrays
        params, opt_state, metric_state = state.params, state.opt_state, state.metric_state
        if self._accumulation == 1 and self._sharded is not None:
            (batch,) = group.batches
            params, opt_state, metric_state = self._train(params, opt_state, metric_state, batch.data, batch.mask,
                                                          batch.count)
        elif self._accumulation == 1:
            (batch,) = group.batches
            params, opt_state, metric_state = run(
                self._steps["train"], (params, opt_state, metric_state, batch.data, batch.mask, batch.count),
                TRAIN_KINDS, TRAIN_OUT, mask=batch.mask, count=batch.count, check_vma=CHECK_VMA)
        elif self._sharded is not None:
            for batch in group.batches:
                params, self._acc, metric_state = self._accumulate(params, opt_state, self._acc, metric_state,
                                                                   batch.data, batch.mask, batch.count)
            count = self._engine.put_replicated(np.float32(group.num_samples))
            params, opt_state, self._acc = self._apply(params, opt_state, self._acc, count)
        else:
            for batch in group.batches:
                params, self._acc, metric_state = run(
                    self._steps["accumulate"], (params, opt_state, self._acc, metric_state, batch.data, batch.mask,
                                                batch.count), ACCUMULATE_KINDS, ACCUMULATE_OUT,
                    mask=batch.mask, count=batch.count, check_vma=CHECK_VMA)
            count = self._engine.put_replicated(np.float32(group.num_samples))
            params, opt_state, self._acc = run(self._steps["apply"], (params, opt_state, self._acc, count),
                                               APPLY_KINDS, APPLY_OUT, check_vma=CHECK_VMA)
        return state.replace(params=params, opt_state=opt_state, metric_state=metric_state, step=state.step + 1,
                             global_step=state.global_step + 1)

    def run(self, state: TrainState, updates: Sequence[AccumulationGroup]) -> TrainState:
        """`state` after the updates of one execution, as few compiled calls as they allow (see
        `lockstep.training._executions`)."""
        for key, run in runs(updates):
            if self._sharded is not None:
                state = self._run_sharded(state, [_placed(update) for update in run])
            elif key is None or (key[0] == "placed" and len(run) == 1):
                for update in run:
                    state = self.step(state, _placed(update))
            else:
                state = self._run(state, key, run)
        return state

    def _run_sharded(self, state: TrainState, run: list[AccumulationGroup]) -> TrainState:
        """A sharded model's updates of one run (placed): consecutive updates of as many batches,
        all of one shape, in one call of the placement's program for them (`Sharded.execution_program`)."""
        def key(update: AccumulationGroup) -> tuple[Any, ...]:
            return len(update.batches), update.batches[0].signature

        i = 0
        while i < len(run):
            j = i + 1
            if all(b.signature == run[i].batches[0].signature for b in run[i].batches):
                while j < len(run) and key(run[j]) == key(run[i]) and all(
                        b.signature == run[i].batches[0].signature for b in run[j].batches):
                    j += 1
            if j - i == 1:
                state = self.step(state, run[i])
            else:
                name = ("sharded", j - i, len(run[i].batches))
                program = self._programs.get(name)
                if program is None:
                    program = self._programs[name] = self._sharded.execution_program(self._steps, *name[1:])
                batches = [b for u in run[i:j] for b in u.batches]
                params, opt_state, metric_state = program(
                    state.params, state.opt_state, state.metric_state, tuple(b.data for b in batches),
                    tuple(b.mask for b in batches), tuple(b.count for b in batches))
                state = state.replace(params=params, opt_state=opt_state, metric_state=metric_state,
                                      step=state.step + j - i, global_step=state.global_step + j - i)
            i = j
        return state

    def _run(self, state: TrainState, key: tuple[Any, ...], run: list[AccumulationGroup]) -> TrainState:
        length, accumulation = len(run), key[2]
        if key[0] == "resident":
            whole = key[1]
            feed, kinds = resident_feed(run, self._start(run[0].batches[0].index))
            resident = (whole.arrays.treedef, whole.per_replica)
        else:
            (feed, kinds), resident = placed_feed(run), None
        program_key = (resident, length, accumulation)
        program = self._programs.get(program_key)
        if program is None:
            program = self._programs[program_key] = self._engine.bind(
                make_program(self._steps, length, accumulation, resident, self._engine.batch_axis),
                (*TRAIN_KINDS[:3], kinds), TRAIN_OUT, check_vma=CHECK_VMA)
        params, opt_state, metric_state = program(state.params, state.opt_state, state.metric_state, feed)
        return state.replace(params=params, opt_state=opt_state, metric_state=metric_state, step=state.step + length,
                             global_step=state.global_step + length)

    def _start(self, i: int) -> jax.Array:
        """Batch number `i` as a replicated int32 on the devices (placed once)."""
        start = self._starts.get(i)
        if start is None:
            if len(self._starts) > 65536:
                self._starts.clear()
            start = self._starts[i] = self._engine.distributor.put_copies(np.int32(i))
        return start

    def evaluate(self, params: Any, state: Any, batch: Any) -> Any:
        """The running loss and metric states after `batch`."""
        return self._engine.run_arrays(self._steps["eval"], (params, state, batch.data, batch.mask, batch.count),
                                       EVAL_KINDS, "per_replica", mask=batch.mask, count=batch.count,
                                       check_vma=CHECK_VMA)

    def predict(self, params: Any, batch: Any) -> Any:
        """The model's outputs on `batch`'s real rows, on the host."""
        out = self._engine.run_arrays(self._steps["predict"], (params, batch.data), PREDICT_KINDS, "per_replica",
                                      mask=batch.mask, count=batch.count, check_vma=CHECK_VMA)
        return jax.tree.map(np.asarray, self._engine.real_rows(out, batch.step))


def _placed(update: AccumulationGroup) -> AccumulationGroup:
    """`update` with its resident batches placed from the host (for the one-step path)."""
    if not any(isinstance(b, ResidentBatch) for b in update.batches):
        return update
    return AccumulationGroup([b.placed() if isinstance(b, ResidentBatch) else b for b in update.batches],
                             update.num_samples)
