"""`RunningMetrics`: the running loss and metrics of a `Trainer`'s loop in progress (an epoch of
`fit`, an evaluation) as callbacks see them, as Keras' loops keep them: read (`metrics_result`,
the Keras metric objects, `keras_metrics_current`), reset (`reset_metrics`) and changed by a user's
hook (`keras_metrics_taken`), the loop going on from what the callbacks left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
        self._looping, self._next_state, self._resets, self._loop_logs = outer or (None, None, 0, None)
        self._metrics_written = "reset due" if outer and self._loop_logs is None else None
        if outer and evaluated is not None:
            self._go_on_from(evaluated)

    def _outer_loop(self) -> tuple[Any, ...] | None:
        """The running state of the loop in progress, where an evaluation begins inside it."""
        return (self._looping, self._next_state, self._resets, self._loop_logs) if self._looping else None

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
            self._go_on_from(self._fresh_state())

    def _go_on_from(self, state: Any) -> None:
        """The loop in progress goes on from the per-replica metric `state`, which the Keras metric
        objects hold, at its next step (fit's epoch at once: a backup taken in this hook holds it)."""
        self._loop_logs, self._metrics_written, self._next_state = None, "held", state
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
        callbacks reset the metrics alike since the last call (else the loop's states would mix).

        Raises:
          WorkersDisagreeError: on every worker, where some reset the metrics and others did not.
        """
        rows, self._resets = allgather_ints([int(bool(flag)), self._resets, int(self._next_state is not None)]), 0
        if len({tuple(row) for row in rows[:, 1:].tolist()}) > 1:
            raise WorkersDisagreeError(
                "a callback reset the metrics (`reset_metrics()`, a metric object's `reset_state()`) or changed them on "
                "some workers and not on others in the same call of steps (by worker: "
                f"{rows[:, 1:].any(axis=1).astype(int).tolist()}): the loss and metrics would mix the workers' counts. "
                "Reset them on every worker (not under `if is_chief()`), as every worker's callbacks run.")
        return bool(rows[:, 0].any())

    def _keras_metric_objects(self) -> dict[str, tuple[Any, Any]]:
        """By name, each of the trainer's metrics that a Keras metric object stands for, and the object."""
        objects = self._adapter.metric_objects()
        out = {}
        for name, metric in self._all.metrics.items():
            metric = metric.inner if isinstance(metric, OutputMetric) else metric  # (its state is the inner metric's)
            target = objects.get(name, getattr(metric, "keras_metric", None))  # (a Keras object given to a Trainer: itself)
            if target is not None:
                out[name] = (metric, target)
        return out

    def _write_metric_objects(self, states: dict[str, Any]) -> None:
        objects = self._keras_metric_objects()
        for name, metric_state in states.items():
            if name in objects:
                write_to_keras(objects[name][0], metric_state, objects[name][1])
        self._objects_written()

    def _loop_begins(self, state: Any = None, training: bool = False) -> None:
        """An epoch or an evaluation begins: its Keras metric objects are to be reset, as Keras'
        loops reset them (before `on_epoch_begin`, after `on_test_begin`), or to hold the per-replica
        metric `state` (an epoch resumed midway: reduced at once, on every worker), and then the
        loop's as its batches end: done when a user's callback asks for them
        (`keras_metrics_current`), else they keep the last loop's states until this one's end."""
        self.last_logs, self._metrics_written = None, "reset due" if state is None else None
        self._loop_logs = None if state is None else LazyLogs(self._engine, self._all, state)
        self._looping, self._next_state, self._resets = "fit" if training else "evaluate", None, 0

    def _batch_logs(self, state: Any, read: bool) -> LazyLogs:
        """The logs of a loop's batch, of its per-replica metric `state` (`LazyLogs`: with several
        workers, where `read`, reduced at once on every worker); the loop's as of this batch."""
        self._loop_logs = LazyLogs(self._engine, self._all, state, read)
        return self._loop_logs

    def keras_metrics_current(self) -> None:
        """The Keras metric objects given the states of the loop in progress as of its last batch
        (reset before it), as Keras' loops update them batch by batch: a reduction over the
        replicas read to the host, which with several workers every worker has dispatched where a
        callback reads the batch's logs (`LazyLogs`), so that one worker may ask alone. In a user's
        hook, what it assigned to them is taken first (`keras_metrics_taken`)."""
        if self._marks is not None:
            self._take_changes()
        self._give_objects()

    def _give_objects(self) -> None:
        logs = self._loop_logs
        if logs is not None and logs is not self._metrics_written:
            self._write_metric_objects(logs.states())
            self._metrics_written = logs
        elif logs is None and self._metrics_written == "reset due":  # a loop before its first batch
            for _, target in self._keras_metric_objects().values():
                reset_keras(target)
            self._objects_written()
            self._metrics_written = "held"

    def metrics_result(self) -> dict[str, Any] | None:
        """Keras' `get_metrics_result` in a loop in progress: its loss and metrics as of its last
        batch (before it, or after a callback reset them, those of its metric objects); None
        outside a loop."""
        if self._marks is not None:  # (in a user's hook: its changes of the metric objects first)
            self._take_changes()
        if self._loop_logs is not None:
            return self._loop_logs.in_order()
        if self._metrics_written not in ("reset due", "held"):
            return None
        self.keras_metrics_current()
        return {name: np.asarray(target.result()).tolist() for name, (_, target) in self._keras_metric_objects().items()}

    _marks: dict[str, tuple[Any, ...]] | None = None  # in a user's hook: the objects' variables' values as lockstep left them
    _hook = ""  # the user's callback whose hook runs (`keras_metrics_taken`)

    @contextlib.contextmanager
    def keras_metrics_taken(self, model_read: Callable[[], bool], who: str) -> Iterator[None]:
        """Inside: the hook of a user's Keras callback (named `who`). In a loop, where the hook read
        the model (`model_read()`: Keras' state sync), what it assigned to the Keras metric objects
        (a metric's ``reset_state()``, ``update_state(...)``) is what the loop goes on from, as Keras'
        loops reread the objects after such a hook (its reads of the running metrics read them);
        else it is ignored, as in Keras.

        Raises:
          UsageError: the hook changed, other than by a reset, a metric object that held an
            earlier batch's state (one not taken from ``self.model.metrics`` in the hook).
        """
        outer = self._marks, self._hook
        self._marks, self._hook = self._object_values() if self._looping else None, who
        try:
            yield
            if self._marks is not None and model_read():
                self._take_changes()
        finally:
            self._marks, self._hook = outer

    def keras_metrics_synced(self) -> None:
        """In a user's hook (`keras_metrics_taken`), its first read of the model: the metric objects it
        changed before are given back the values they held, as Keras' state sync overwrites them."""
        if self._marks is None:
            return
        for name, (_, target) in self._keras_metric_objects().items():
            for v, before in zip(target.variables, self._marks.get(name, ())):
                if getattr(v, "_value", None) is not before:
                    v.assign(before)
        self._objects_written()

    def _object_values(self) -> dict[str, tuple[Any, ...]]:
        """The values the Keras metric objects' variables hold, by the objects' names."""
        return {name: tuple(getattr(v, "_value", None) for v in target.variables)
                for name, (_, target) in self._keras_metric_objects().items()}

    def _objects_written(self) -> None:
        """lockstep (not the user's hook) wrote the Keras metric objects."""
        if self._marks is not None:
            self._marks = self._object_values()

    def _take_changes(self) -> None:
        """The loop goes on from the states of the Keras metric objects a user's hook changed since
        lockstep wrote them (placed in the first replica), the others' as they run."""
        changed = [name for name, values in self._object_values().items()
                   if any(a is not b for a, b in zip(values, self._marks.get(name, values)))]
        if not changed:
            return
        objects = self._keras_metric_objects()
        if not (self._metrics_written == "held" or (self._loop_logs is not None and self._metrics_written is self._loop_logs)):
            wrong = [name for name in changed if not is_reset(objects[name][1])]
            if wrong:
                raise UsageError(
                    f"the Keras callback {self._hook} changed the metric object(s) {wrong} in a hook, other than by "
                    "reset_state(), while they held an earlier batch's state: lockstep gives the metric objects the "
                    "loop's running state when a hook reads them from `self.model.metrics`, as Keras' loops keep them. "
                    "Take them from `self.model.metrics` in the hook before changing them.")
            self._give_objects()  # the others given the loop's state (a batch's logs: reduced on every worker)
            for name in changed:
                reset_keras(objects[name][1])
        taken = {name: read_from_keras(*objects[name]) for name in changed}
        saved = {name: jax.tree.map(lambda a: np.asarray(a)[None], state) for name, state in taken.items() if state is not None}
        running = self._next_state if self._next_state is not None else (
            self._state.metric_state if self._looping == "fit" else
            self._loop_logs.state if self._loop_logs is not None else self._fresh_state())
        self._go_on_from({**running, **per_replica_metric_state(self._engine, self._all, saved)})
        self._objects_written()
