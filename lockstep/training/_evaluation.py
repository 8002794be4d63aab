"""`TrainerEvaluation`: the passes of a `Trainer` that do not train, `evaluate` (and fit's
validation) and `predict`, batch by batch through the compiled steps, with the callbacks called
as Keras' own loops call them: once per call of `steps_per_execution` batches (`calls`).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from .._errors import WorkersDisagreeError
from ..callbacks import Callback, CallbackList, format_logs, is_chief
from ..cluster import agree_on
from ..data import DataAdapter
from ..engine import allgather_ints
from ..metrics import reset_keras, write_to_keras
from ._executions import calls, whole_calls
from ._inputs import checked_steps, to_batches
from ._labels import LabelCheck, checked
from ._logs import LazyLogs, ended_logs
from ._outputs import OutputMetric
from ._worker_settings import fit_settings


def agreed(flag: bool) -> bool:
    """True on every worker where `flag` is true on any (a collective with several workers): where
    one stops, all do.

    >>> agreed(False), agreed(True)  # one worker
    (False, True)
    """
    return bool(np.any(allgather_ints([int(bool(flag))])))


def batches_in(data: Any) -> int | None:
    """The number of batches of `data`; None without a length (a generator, a tf.data dataset of
    unknown cardinality)."""
    try:
        return len(data)
    except TypeError:
        return None


def note_weighted_metrics(sample_weight: Any, metrics: Any) -> None:
    """Warns where `sample_weight` weighs metrics that Keras 3 would not weigh."""
    weighted = sorted(k for k, m in metrics.metrics.items() if m.weighted is None)  # Trainer(metrics=...)'s
    if sample_weight is not None and weighted:
        warnings.warn(
            "`sample_weight` weighs the loss and every metric given to the Trainer; Keras 3 weighs only "
            f"`weighted_metrics` (its `metrics` ignore sample weights, as do a compiled model's here): {weighted} "
            "are weighted here.", UserWarning, stacklevel=3)


def _loop_params(verbose: int | str, data: Any, steps: int | None = None) -> dict[str, Any]:
    """The `params` Keras gives the callbacks of `evaluate` / `predict`: `verbose`, one epoch, and
    the batches (`steps` where given; None where the data's length is unknown)."""
    return {"verbose": verbose, "epochs": 1, "steps": steps or batches_in(data)}


class TrainerEvaluation:
    """Mixed into `Trainer` (it reads `_runner`, `_state`, `_engine`, `_all`, `_labels`, `strategy`,
    `steps_per_execution`, `callback_adapter`, `stop_training`, makes metric states with `_fresh_state`
    and builds the model on the first batch with `_build_on`). It also keeps the running loss and
    metrics of fit's epochs: what a callback reads of them, and resets."""

    _runner: Any
    _adapter: Any
    _state: Any
    _engine: Any
    _all: Any
    _labels: LabelCheck
    _metrics: Any
    strategy: Any
    steps_per_execution: int
    callback_adapter: Any
    stop_training: bool
    stop_evaluating: bool
    stop_predicting: bool
    _inference_changed = False
    model: Any
    sync_model: Any
    last_logs: dict[str, Any] | None
    _loop_logs: LazyLogs | None = None  # in a loop (an epoch, an evaluation): its logs as of its last batch
    _metrics_written: Any = None  # the logs whose states the Keras metric objects were given; "reset due"
    # (before the loop's first batch); "held": the objects hold the loop's state (`keras_metrics_current`)
    _looping: str | None = None  # the loop in progress: "fit" (an epoch) or "evaluate"
    _next_state: Any = None  # the metric state the loop goes on from at its next step (`_go_on_from`)
    _resets = 0  # the steps that went on from another state since the workers last agreed (`_agreed_in_loop`)
    _build_on: Any
    _fresh_state: Any

    def _calls(self, data: DataAdapter, steps: int | None) -> Iterator[tuple[int, list[Any]]]:
        """The calls of an `evaluate` / `predict` loop over `data` (its first `steps` batches, in
        whole calls), the data told where the loop begins and, once the loop asks past its last
        call (not stopped by a callback), that it ended (a `PyDataset`'s hooks, as in Keras)."""
        data.loop_begins()
        batches = itertools.islice(data.distributed(self._engine), whole_calls(steps, self.steps_per_execution))
        yield from calls(batches, self.steps_per_execution)
        data.loop_ended()

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

    def _stops_after_call(self, cblist: CallbackList) -> bool:
        """Whether fit stops after a call of its steps: where a callback that may stop mid-epoch
        (`stops_in_batches`) asked on any worker, all workers stop."""
        if cblist.stops_in_batches:
            self.stop_training = self._agreed_in_loop(self.stop_training)
        return self.stop_training

    def _agreed_in_loop(self, flag: bool) -> bool:
        """`agreed(flag)` after a call of a loop's steps, where the workers also check that their
        callbacks reset the metrics alike since the last call (else the loop's states would mix).

        Raises:
          WorkersDisagreeError: on every worker, where some reset the metrics and others did not.
        """
        rows, self._resets = allgather_ints([int(bool(flag)), self._resets, int(self._next_state is not None)]), 0
        if len({tuple(row) for row in rows[:, 1:].tolist()}) > 1:
            raise WorkersDisagreeError(
                "a callback called `reset_metrics()` on some workers and not on others in the same call of steps "
                f"(reset by worker: {rows[:, 1:].any(axis=1).astype(int).tolist()}): the loss and metrics would mix "
                "the workers' counts. "
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
        callback reads the batch's logs (`LazyLogs`), so that one worker may ask alone."""
        logs = self._loop_logs
        if logs is not None and logs is not self._metrics_written:
            self._write_metric_objects(logs.states())
            self._metrics_written = logs
        elif logs is None and self._metrics_written == "reset due":  # a loop before its first batch
            for _, target in self._keras_metric_objects().values():
                reset_keras(target)
            self._metrics_written = "held"

    def metrics_result(self) -> dict[str, Any] | None:
        """Keras' `get_metrics_result` in a loop in progress: its loss and metrics as of its last
        batch (before it, or after a callback reset them, those of its metric objects); None
        outside a loop."""
        if self._loop_logs is not None:
            return self._loop_logs.in_order()
        if self._metrics_written not in ("reset due", "held"):
            return None
        self.keras_metrics_current()
        return {name: np.asarray(target.result()).tolist() for name, (_, target) in self._keras_metric_objects().items()}

    def _predicted(self, batch: Any) -> Any:
        outputs, params = self._runner.predict(self._state.params, batch)
        self._keep_inference_state(params)
        return outputs

    def _keep_inference_state(self, params: Any) -> None:
        """Keeps the non-trainable state an evaluate or predict step changed (Monte-Carlo dropout's
        seed state, moving statistics of a `BatchNormalization` called with ``training=True``), as
        Keras' loops keep it; the model object gets it when the loop ends (`_sync_inference_state`)."""
        if params is not self._state.params:
            self._state = self._state.replace(params=params)
            self._inference_changed = True

    def _sync_inference_state(self) -> None:
        """Writes the state an evaluate or predict changed into the model object, as Keras' loops
        end (a collective where the layout pads: every worker's loop changed the same)."""
        if self._inference_changed:
            self._inference_changed = False
            self.sync_model()

    def _evaluate_batches(self, data: DataAdapter, cblist: CallbackList, y: Any = None,
                          arg: str = "validation_data", steps: int | None = None) -> tuple[dict[str, Any], Any]:
        """An evaluation's loop: its logs, and the per-replica metric state it ended on."""
        data = checked(data, self._labels, y, arg, inputs=self._build_on(data, "x" if arg in ("x", "y") else arg, y, arg))
        state = self._fresh_state()
        self.stop_evaluating = False
        cblist.on_test_begin()
        self._loop_begins()  # (after the hook, as Keras' evaluate resets its metrics)
        for step, group in self._calls(data, steps):
            cblist.on_test_batch_begin(step)
            state = self._continued(state)
            for batch in group:
                state, params = self._runner.evaluate(self._state.params, state, batch)
                self._keep_inference_state(params)
            cblist.on_test_batch_end(step + len(group) - 1, self._batch_logs(state, cblist.reads["on_test_batch_end"]))
            if cblist.in_batches["testing"] and self._agreed_in_loop(self.stop_evaluating):
                break
        state = self._continued(state)
        logs = self.last_logs = self._ended(state)
        cblist.on_test_end(dict(sorted(logs.items())))
        return logs, state

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, sample_weight: Any = None,
                 verbose: int | str = 0, callbacks: Iterable[Callback] | None = None, return_dict: bool = True,
                 steps: int | None = None) -> dict[str, Any] | list[Any]:
        """Loss and metrics over the whole data (its first `steps` batches), exactly as one device computes them.

        Returns:
          ``{"loss": ..., <metric name>: ...}`` (a list in that order if `return_dict` is False).
        """
        agree_on("the settings of evaluate", lambda: fit_settings(self, dict(batch_size=batch_size, steps=steps)))
        data = to_batches(self.strategy, x, y, sample_weight, batch_size, False, 0)
        note_weighted_metrics(sample_weight, self._metrics)
        cblist = CallbackList(map(self.callback_adapter, callbacks or []), self, _loop_params(verbose, data, checked_steps(steps)))
        outer, evaluated = self._outer_loop(), None  # (a callback's `self.model.evaluate()` in a loop)
        try:
            logs, evaluated = self._evaluate_batches(data, cblist, y, "y" if y is not None else "x", checked_steps(steps))
        finally:
            self._loop_ends(outer, evaluated)  # (cut short: its last batch's state may be gone)
        self._sync_inference_state()
        if verbose and is_chief():
            print(format_logs(logs))
        return logs if return_dict else list(logs.values())

    def predict(self, x: Any, batch_size: int | None = None, verbose: int | str = 0,
                callbacks: Iterable[Callback] | None = None, steps: int | None = None) -> Any:
        """The model's outputs for every sample: exactly `len(x)` rows (those of the first `steps`
        batches), in input order (NumPy)."""
        steps = checked_steps(steps)
        agree_on("the settings of predict", lambda: fit_settings(self, dict(batch_size=batch_size, steps=steps)))
        data = to_batches(self.strategy, x, None, None, batch_size, False, 0)
        data = checked(data, LabelCheck(None), None, "x", inputs=self._build_on(data, "x", metrics=False))
        cblist = CallbackList(map(self.callback_adapter, callbacks or []), self, _loop_params(verbose, data, steps))
        self.stop_predicting = False
        cblist.on_predict_begin()
        outputs = []
        for step, group in self._calls(data, steps):
            cblist.on_predict_batch_begin(step)
            outputs.append(_joined([self._predicted(batch) for batch in group]))
            cblist.on_predict_batch_end(step + len(group) - 1, {"outputs": outputs[-1]})  # the call's, as in Keras
            if cblist.in_batches["predicting"] and agreed(self.stop_predicting):
                break
        self._sync_inference_state()
        cblist.on_predict_end()
        return _joined(outputs)


def _joined(parts: list[Any]) -> Any:
    """Outputs of consecutive batches as one (NumPy, along the batch axis)."""
    return jax.tree.map(lambda *p: np.concatenate(p, axis=0), *parts)
