"""`RunningMetrics`: the running loss and metrics of a `Trainer`'s loop in progress (an epoch of
`fit`, an evaluation) as callbacks see them, as Keras' loops keep them: read (`metrics_result`,
the Keras metric objects, `keras_metrics_current`), reset (`reset_metrics`) and changed by a user's
callback (`keras_metrics_synced`, `_take_pending`), the loop going on from what the callbacks left, as
Keras' JAX loops go on from their metric objects where a callback synced the model's state.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import numpy as np

from .._errors import UsageError, WorkersDisagreeError
from ..engine import allgather_ints
from ..metrics import is_reset, read_from_keras, reset_keras, write_to_keras
from ._logs import LazyLogs, ended_logs
from ._outputs import OutputMetric
from ._restore import per_replica_metric_state


class RunningMetrics:
    """Mixed into `Trainer` (it reads `_adapter`, `_state`, `_engine`, `_all`, `model`, and makes
    metric states with `_fresh_state`): the running loss and metrics of the loop in progress."""

    _adapter: Any
    _state: Any
    _engine: Any
    _all: Any
    model: Any
    last_logs: dict[str, Any] | None
    _fresh_state: Any
    _loop_logs: LazyLogs | None = None  # in a loop (an epoch, an evaluation): its logs as of its last batch
    _metrics_written: Any = None  # the logs whose states the Keras metric objects were given; "reset due"
    # (before the loop's first batch); "held": the objects hold the loop's state (`keras_metrics_current`)
    _looping: str | None = None  # the loop in progress: "fit" (an epoch) or "evaluate"
    _next_state: Any = None  # the metric state the loop goes on from at its next step (`_go_on_from`)
    _resets = 0  # the steps that went on from another state since the workers last agreed (`_agreed_in_loop`)
    _marks: dict[str, tuple[Any, ...]] | None = None  # in a loop a user's callback runs in: the values of the
    # Keras metric objects' variables as lockstep left them (a callback changed those that differ)
    _synced = True  # Keras' state sync (`_jax_state_synced`): the objects' changes since are the loop's
    _objects: dict[str, tuple[Any, Any]] | None = None  # the loop's `_keras_metric_objects()`
    _digest = 0  # which metrics the loop went on from another state of since the workers last agreed
    _ran = False  # whether a call of the loop's steps ran
    _error: UsageError | None = None  # a change of the metric objects refused, raised at the workers' next agreement

    def _ended(self, state: Any) -> dict[str, Any]:
        """The logs of a loop that ended on the per-replica metric `state`; the Keras metric objects
        (those given, and the model's own: `adapter.metric_objects`) are given their states, as Keras'
        loops leave them."""
        logs, states = ended_logs(self._engine, self._all, state)
        self._loop_ends()
        self._write_metric_objects(states)
        return logs

    def _loop_ends(self, outer: tuple[Any, ...] | None = None, evaluated: Any = None) -> None:
        """A loop ended (or was cut short): nothing runs, or the `outer` loop again (`_outer_loop`:
        a callback's `evaluate` in a loop), going on from the per-replica metric state `evaluated`
        (the evaluation's, where it ended), as Keras' loop goes on from the metric objects the
        evaluation left."""
        (self._looping, self._next_state, self._resets, self._loop_logs, self._marks, self._synced, self._digest,
         self._objects, self._ran, self._error) = outer or (None, None, 0, None, None, True, 0, None, False, None)
        self._metrics_written = "reset due" if outer and self._loop_logs is None else None
        if outer and evaluated is not None:
            self._go_on_from(evaluated)
            self._objects_written()  # (they hold the evaluation's state: the loop's now)
            self._synced = True  # (as Keras' evaluate syncs as it ends)

    def _outer_loop(self) -> tuple[Any, ...] | None:
        """The running state of the loop in progress, where an evaluation begins inside it."""
        return (self._looping, self._next_state, self._resets, self._loop_logs, self._marks, self._synced, self._digest,
                self._objects, self._ran, self._error) if self._looping else None

    def reset_metrics(self) -> None:
        """Keras' `reset_metrics`: the loss and metrics read reset (`metrics_result`), and in a loop
        in progress (a callback's call) they start again from its next step, as in Keras' loops
        (with several workers, where every worker's callbacks reset them alike: checked after the
        call of steps, `_agreed_in_loop`)."""
        self.last_logs = None
        objects = [target for _, target in self._keras_metric_objects().values()]
        for target in [*objects, *getattr(self.model, "metrics", [])]:  # (a Keras model's own too)
            reset_keras(target)  # without Keras' broadcast from worker 0: one worker may ask alone
        self._objects_written()
        if self._looping:
            self._go_on_from(self._fresh_state(), ["*"])

    def keras_model_reset(self) -> None:
        """The Keras model's own `reset_metrics()` (on the model, not a callback's ``self.model``): in
        a loop where no callback synced since its last steps, its metric objects alone are reset, and
        undone before the steps, as Keras' next sync overwrites them; else `reset_metrics`."""
        if not (self._looping and self._marks is not None and not self._synced):
            return self.reset_metrics()
        self._reset_objects()  # (not marked as lockstep's: undone, `_take_pending`)

    def _reset_objects(self) -> None:
        for _, target in self._keras_metric_objects().values():
            reset_keras(target)  # without Keras' broadcast from worker 0: one worker may ask alone

    def _go_on_from(self, state: Any, names: list[str] | None = None) -> None:
        """The loop in progress goes on from the per-replica metric `state`, which the Keras metric
        objects hold, at its next step (fit's epoch at once: a backup taken in this hook holds it);
        `names`: the metrics whose states changed, which the workers compare (`_agreed_in_loop`)."""
        self._loop_logs, self._metrics_written, self._next_state = None, "held", state
        if names is not None:
            self._digest = (self._digest * 31 + zlib.crc32(",".join(names).encode())) & 0x3FFFFFFF
        if self._looping == "fit":
            self._state = self._state.replace(metric_state=self._continued(None))

    def _continued(self, state: Any) -> Any:
        """The loop's per-replica metric `state`, or the one it goes on from (`_go_on_from`)."""
        if self._next_state is None:
            return state
        state, self._next_state, self._resets = self._next_state, None, self._resets + 1
        return state

    def _agreed_in_loop(self, flag: bool) -> bool:
        """`agreed(flag)` after a call of a loop's steps, where the workers also check that their
        callbacks reset or changed the same metrics since the last call (else the loop's states would
        mix): what they changed in the metric objects is taken first (`_take_pending`).

        Raises:
          UsageError: on every worker, where a callback changed a metric object on some (`_take_pending`).
          WorkersDisagreeError: on every worker, where some reset or changed the metrics and others did not.
        """
        self._take_pending(at_steps=False)  # (unsynced changes stay until the steps, as in Keras)
        rows = allgather_ints([int(bool(flag)), self._resets, int(self._next_state is not None), self._digest,
                               int(self._error is not None)])
        self._resets = self._digest = 0
        if rows[:, 4].any():  # (on every worker)
            raise self._error or UsageError(f"worker(s) {np.flatnonzero(rows[:, 4]).tolist()} raised: a callback changed a "
                                      "metric object other than by reset_state() while it held an earlier batch's state.")
        rows = rows[:, :4]
        if len({tuple(row) for row in rows[:, 1:].tolist()}) > 1:
            raise WorkersDisagreeError(
                "a callback reset the metrics (`reset_metrics()`, a metric object's `reset_state()`) or changed them on "
                "some workers and not on others in the same call of steps (by worker: "
                f"{rows[:, 1:].any(axis=1).astype(int).tolist()}): the loss and metrics would mix the workers' counts. "
                "Reset them on every worker (not under `if is_chief()`), as every worker's callbacks run.")
        return bool(rows[:, 0].any())

    def _keras_metric_objects(self) -> dict[str, tuple[Any, Any]]:
        """By name, each of the trainer's metrics that a Keras metric object stands for, and the object
        (found once a loop)."""
        if self._looping and self._objects is not None:
            return self._objects
        objects = self._adapter.metric_objects()
        out = {}
        for name, metric in self._all.metrics.items():
            metric = metric.inner if isinstance(metric, OutputMetric) else metric  # (its state is the inner metric's)
            target = objects.get(name, getattr(metric, "keras_metric", None))  # (a Keras object given to a Trainer: itself)
            if target is not None:
                out[name] = (metric, target)
        if self._looping:
            self._objects = out
        return out

    def _write_metric_objects(self, states: dict[str, Any]) -> None:
        objects = self._keras_metric_objects()
        for name, metric_state in states.items():
            if name in objects:
                write_to_keras(objects[name][0], metric_state, objects[name][1])
        self._objects_written()

    def _loop_begins(self, state: Any = None, training: bool = False, watch: bool = False) -> None:
        """An epoch or an evaluation begins: its Keras metric objects are to be reset, as Keras'
        loops reset them (before `on_epoch_begin`, after `on_test_begin`), or to hold the per-replica
        metric `state` (an epoch resumed midway: reduced at once, on every worker), and then the
        loop's as its batches end: done when a user's callback asks for them
        (`keras_metrics_current`), else they keep the last loop's states until this one's end. Where
        a user's callback runs (`watch`), at once, and what it changes in them is watched."""
        self.last_logs, self._metrics_written = None, "reset due" if state is None else None
        self._loop_logs = None if state is None else LazyLogs(self._engine, self._all, state)
        self._looping, self._next_state, self._resets, self._digest = "fit" if training else "evaluate", None, 0, 0
        self._objects, self._marks, self._synced, self._ran = None, None, True, False  # (Keras' loops sync as they begin)
        self._error = None
        if watch:
            self._give_objects()
            self._marks = self._object_values()

    def _batch_logs(self, state: Any, read: bool) -> LazyLogs:
        """The logs of a loop's batch, of its per-replica metric `state` (`LazyLogs`: with several
        workers, where `read`, reduced at once on every worker); the loop's as of this batch."""
        self._loop_logs, self._synced, self._ran = LazyLogs(self._engine, self._all, state, read), False, True
        return self._loop_logs

    def keras_metrics_current(self) -> None:
        """The Keras metric objects given the states of the loop in progress as of its last batch
        (reset before it), as Keras' loops update them batch by batch: a reduction over the
        replicas read to the host, which with several workers every worker has dispatched where a
        callback reads the batch's logs (`LazyLogs`), so that one worker may ask alone. What a
        callback assigned to them since a sync is taken first (`_take_pending`)."""
        self._take_pending(at_steps=False)
        self._give_objects()

    def _give_objects(self) -> None:
        logs = self._loop_logs
        if logs is not None and logs is not self._metrics_written:
            self._write_metric_objects(logs.states())
            self._metrics_written = logs
        elif logs is None and self._metrics_written == "reset due":  # a loop before its first batch
            self._reset_objects()
            self._objects_written()
            self._metrics_written = "held"

    def metrics_result(self) -> dict[str, Any] | None:
        """Keras' `get_metrics_result` in a loop in progress: its loss and metrics as of its last
        batch (before it, or after a callback reset them, those of its metric objects); None
        outside a loop."""
        self._take_pending(at_steps=False)  # (what a callback assigned to the metric objects first)
        if self._loop_logs is not None:
            return self._loop_logs.in_order()
        if self._metrics_written not in ("reset due", "held"):
            return None
        self.keras_metrics_current()
        return {name: np.asarray(target.result()).tolist() for name, (_, target) in self._keras_metric_objects().items()}


    def keras_metrics_synced(self) -> None:
        """A callback read the model (``self.model``: Keras' `jax_state_sync`). The first read since the
        loop's last steps syncs, as in Keras' loops: what callbacks assigned to the metric objects
        before is undone (Keras' sync overwrites it), and from then on what they assign is what the
        loop goes on from at its next steps (`_take_pending`), as Keras' loops reread the objects."""
        if self._marks is not None and not self._synced:
            self._undo(self._changed())
            self._synced = True

    def _changed(self) -> list[str]:
        """The metric objects whose variables a callback assigned since lockstep left them."""
        return [name for name, values in self._object_values().items()
                if any(a is not b for a, b in zip(values, self._marks.get(name, values)))]

    def _undo(self, changed: list[str]) -> None:
        objects = self._keras_metric_objects()
        for name in changed:
            for v, before in zip(objects[name][1].variables, self._marks[name]):
                if getattr(v, "_value", None) is not before:
                    v.assign(before)

    def _object_values(self) -> dict[str, tuple[Any, ...]]:
        """The values the Keras metric objects' variables hold, by the objects' names."""
        return {name: tuple(getattr(v, "_value", None) for v in target.variables)
                for name, (_, target) in self._keras_metric_objects().items()}

    def _objects_written(self) -> None:
        """lockstep (not a callback) wrote the Keras metric objects."""
        if self._marks is not None:
            self._marks = self._object_values()

    def _loop_settles(self, agree: bool) -> None:
        """As the loop ends: what callbacks changed in the metric objects is taken, and where no call
        of steps ran (an epoch resumed at its end) and a user's callback runs (`agree`, alike on
        every worker), the workers check they reset the same metrics (`_agreed_in_loop`)."""
        self._take_pending()
        if agree and not self._ran:
            self._agreed_in_loop(False)
        if self._error is not None:  # (after the agreement of the loop's last call: on every worker)
            raise self._error

    def keras_metrics_taken(self) -> None:
        """After a user's callback's hook: what callbacks changed in the metric objects since a sync
        is the loop's at once, as at its next steps (a backup taken next holds it)."""
        self._take_pending(at_steps=False)

    def _take_pending(self, at_steps: bool = True) -> None:
        """Before a loop's steps (`at_steps`: and its end; else a read of its metrics): the metric
        objects a callback changed are what it goes on from, where one synced (else, at its steps,
        the changes are undone, as Keras' next sync overwrites them): their states placed in the
        first replica, the others' as they run.

        Where a callback changed, other than by a reset, a metric object that held an earlier batch's
        state (one it kept, not taken from ``self.model.metrics`` then), that is a `UsageError`, which
        every worker raises at their next agreement (`_agreed_in_loop`): none is left in a collective.
        """
        changed = [] if self._marks is None else self._changed()
        if not self._synced and at_steps:
            self._undo(changed)
        if not changed or not self._synced:
            return
        objects = self._keras_metric_objects()
        if not ((self._loop_logs is None and self._metrics_written == "held")
                or (self._loop_logs is not None and self._metrics_written is self._loop_logs)):
            wrong = [name for name in changed if not is_reset(objects[name][1])]
            if wrong:  # (raised by every worker at their next agreement: `_agreed_in_loop`)
                self._error = UsageError(
                    f"a callback changed the metric object(s) {wrong} other than by reset_state() while they held an "
                    "earlier batch's state: lockstep gives the metric objects the loop's running state when a callback "
                    "reads them from `self.model.metrics`, as Keras' loops keep them. Take them from "
                    "`self.model.metrics` in the hook before changing them.")
                return
            self._give_objects()  # the others given the loop's state (a batch's logs: reduced on every worker)
            for name in changed:
                reset_keras(objects[name][1])
        taken = {name: read_from_keras(*objects[name]) for name in changed}
        saved = {name: jax.tree.map(lambda a: np.asarray(a)[None], state) for name, state in taken.items() if state is not None}
        if not saved:  # (objects that do not stand for a state: what lockstep reports is its own)
            return self._objects_written()
        running = self._next_state if self._next_state is not None else (
            self._state.metric_state if self._looping == "fit" else
            self._loop_logs.state if self._loop_logs is not None else self._fresh_state())
        self._go_on_from({**running, **per_replica_metric_state(self._engine, self._all, saved)}, sorted(saved))
        self._objects_written()
