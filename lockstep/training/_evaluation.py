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

from ..callbacks import Callback, CallbackList, format_logs, is_chief
from ..cluster import agree_on
from ..data import DataAdapter
from ..engine import allgather_ints
from ._executions import calls, whole_calls
from ._inputs import checked_steps, to_batches
from ._labels import LabelCheck, checked
from ._running_metrics import RunningMetrics
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


class TrainerEvaluation(RunningMetrics):
    """Mixed into `Trainer` (it reads `_runner`, `_state`, `_engine`, `_all`, `_labels`, `strategy`,
    `steps_per_execution`, `callback_adapter`, `stop_training`, makes metric states with `_fresh_state`
    and builds the model on the first batch with `_build_on`)."""

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

    def _stops_after_call(self, cblist: CallbackList) -> bool:
        """Whether fit stops after a call of its steps: where a callback that may stop mid-epoch
        (`stops_in_batches`) asked on any worker, all workers stop."""
        if cblist.stops_in_batches:
            self.stop_training = self._agreed_in_loop(self.stop_training)
        return self.stop_training

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
        self._loop_begins(watch=cblist.watches)  # (after the hook, as Keras' evaluate resets its metrics)
        for step, group in self._calls(data, steps):
            cblist.on_test_batch_begin(step)
            self._take_pending()  # (what callbacks changed in the metric objects, as Keras' loops reread them)
            state = self._continued(state)
            for batch in group:
                state, params = self._runner.evaluate(self._state.params, state, batch)
                self._keep_inference_state(params)
            cblist.on_test_batch_end(step + len(group) - 1, self._batch_logs(state, cblist.reads["on_test_batch_end"]))
            if cblist.in_batches["testing"] and self._agreed_in_loop(self.stop_evaluating):
                break
        self._loop_settles(False)  # (the agreement after its last call: `_agreed_in_loop`)
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
