"""`Trainer`: Keras-style `fit` / `evaluate` / `predict` on any strategy, with exact numbers.

>>> import jax, jax.numpy as jnp, numpy as np, lockstep as ls
>>> model = ls.FunctionalModel(
...     init=lambda rng, x: {"w": jnp.zeros((x.shape[-1], 3)), "b": jnp.zeros(3)},
...     apply=lambda p, x, training=False: x @ p["w"] + p["b"])
>>> x = np.random.default_rng(0).normal(size=(103, 4)).astype(np.float32); y = (x[:, 0] > 0).astype(int)
>>> trainer = ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
...                      metrics=["accuracy"], strategy=ls.MirroredStrategy(4))
>>> history = trainer.fit(x, y, batch_size=16, epochs=3, verbose=0); sorted(trainer.evaluate(x, y, batch_size=16))
['accuracy', 'loss']
>>> trainer.predict(x, batch_size=16).shape, trainer.train_state.global_step   # 7 steps an epoch
((103, 3), 21)
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import optax

from ..cluster import agree_on
from .. import losses as _losses
from ..distribute import Strategy, get_strategy, recent, strategy_of_model
from ..callbacks import Callback, CallbackList, History, ProgbarLogger, is_chief
from ..data import IterableBatches
from ..metrics import Mean, Metric, MetricCollection, get as get_metric
from ..sharding import Replicated
from ._inputs import (
    class_weighted,
    first_batch,
    Validation,
    split_validation,
    to_batches,
    validation_batches,
    validation_labels,
)
from ..data import DataStream
from ._evaluation import TrainerEvaluation, agreed, batches_in, note_weighted_metrics
from ._executions import executions, whole_calls
from ._input_shapes import InputCheck
from ._labels import LabelCheck, checked
from ._model import FunctionalModel, adapt, checked_batch_statistics, output_shape
from ._outputs import shapes_of
from ._precision import in_precision, resolve_policy, skipped_steps
from ._settings import ModelSettings, checked_steps_per_execution, given_settings
from ._restore import fit_start, initial_state, placed, snapshot, take_up
from ._train_state import TrainState
from ._state_names import state_names
from ._measures import TrainerMeasures
from ._step_runner import StepRunner, checked_accumulation
from ._weight_files import WeightFiles
from ._weights import TrainerWeights, copied_where_held
from ._worker_settings import fit_settings
from ._steps import checked_remat, make_steps, unpack


def _strategy_for(model: Any, given: Any) -> Strategy:
    """`given` (checked); else the active scope's strategy; else, for a Keras model built in a
    scope, that scope's strategy."""
    if given is not None:
        if not isinstance(given, Strategy):
            raise TypeError(f"`strategy` must be a lockstep strategy, got {type(given).__name__}.")
        return given
    found = strategy_of_model(model)
    if found is not None and (found.num_replicas_in_sync > 1 or strategy_of_model(model, by_devices=False)):
        return found
    # one device: the default, or a one-device strategy whose devices merely hold the variables
    variables = getattr(model, "variables", None) or []
    default = found or get_strategy()
    if variables and any(st.num_replicas_in_sync > 1 for st in recent()):
        warnings.warn(
            "this Trainer runs on one device (no strategy given, no scope active, and the model was not built "
            "in a strategy's scope): pass `strategy=`, or create the Trainer inside `strategy.scope()`.",
            stacklevel=3)
    return default


def _metric_collections(metrics: Any) -> tuple[Mean, MetricCollection, MetricCollection]:
    """(loss tracker, the metrics, all of them with the loss first) from `Trainer`'s `metrics`."""
    if metrics is not None and (isinstance(metrics, (str, Metric)) or not isinstance(metrics, Iterable)):
        raise TypeError(f"`metrics` must be a list of metrics or names, got {metrics!r}.")
    loss_tracker = Mean(name="loss")
    resolved = [get_metric(m) for m in (metrics or [])]
    for m in resolved:
        _check_takes_labels(m)
    everything = MetricCollection([loss_tracker, *resolved])
    others = MetricCollection({k: m for k, m in everything.metrics.items() if m is not loss_tracker})
    return loss_tracker, others, everything


def _check_takes_labels(metric: Metric) -> None:
    params = inspect.signature(metric.batch_state).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name != "sample_weight"]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(
            f"`metrics` holds {type(metric).__name__} `{metric.name}`, which takes `values`, not "
            "(y_true, y_pred); wrap a per-sample function in lockstep.metrics.MeanMetricWrapper instead.")


def _fit_callbacks(cbs: list[Callback], verbose: int | str, train: Iterable[Any], epochs: int,
                   steps_per_epoch: int | None, accumulation: int) -> tuple[list[Callback], dict[str, Any]]:
    """(`cbs` with a progress bar first when `verbose` asks for one (on the chief only), and the
    `params` every callback is given, as Keras gives them: verbose, epochs and steps an epoch, in
    optimizer steps (groups of `accumulation` batches): `steps_per_epoch` as given, else a pass's)."""
    shown = 1 if verbose == "auto" else int(verbose)
    steps = None if (batches := batches_in(train)) is None else -(-batches // accumulation)
    params = {"verbose": verbose, "epochs": epochs,
              "steps": steps_per_epoch or steps}
    return ([ProgbarLogger(shown)] if shown and is_chief() else []) + cbs, params


def _check_fit_args(epochs: Any, validation_split: Any, steps_per_epoch: Any, verbose: Any = 0) -> None:
    if verbose not in (0, 1, 2, "auto") or isinstance(verbose, float):
        raise ValueError(f"`verbose` must be 0, 1, 2 or 'auto', got verbose={verbose!r}.")
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"`epochs` must be a non-negative integer, got epochs={epochs!r}.")
    if not isinstance(validation_split, (int, float)) or not 0.0 <= validation_split < 1.0:
        raise ValueError(f"`validation_split` must be in (0, 1) (or 0 for none), got validation_split={validation_split!r}.")
    if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
        raise ValueError(f"`steps_per_epoch` must be a positive integer, got steps_per_epoch={steps_per_epoch!r}.")


def own_state(live: TrainState, state: TrainState) -> TrainState:
    """`state` (the `live` one in its variables' shapes) with copies of the arrays that are the
    trainer's own, which its next step takes over (a background backup writes its own; see
    `StepRunner`)."""
    params, opt_state = copied_where_held(live, (state.params, state.opt_state))
    return state.replace(params=params, opt_state=opt_state)


class Trainer(TrainerEvaluation, TrainerWeights, WeightFiles, TrainerMeasures):
    """Trains, evaluates and predicts with a model on a strategy, Keras style.

    Every number it reports — losses, metrics, evaluation results, predictions, callback
    decisions — is the number one device would report on the whole data: batches are split
    across replicas with padding masks, and metric *states* are reduced, never metric values.
    The whole state of a `fit` in progress is one `TrainState` (`train_state` / `restore`).

    Args:
      model: a `lockstep.FunctionalModel`, or a Keras 3 model (JAX backend) given to
        `lockstep.Trainer` (`lockstep.keras.Trainer`: this class with Keras' model adapter and
        `compile`'s settings). For a Keras model on which `compile` was called, the optimizer, loss
        and metrics left out here are the compiled ones.
      optimizer: an optax transformation, a Keras optimizer (run by Keras' own update), or a name
        (``"adam"``, ``"adamw"``, ``"sgd"``, ``"rmsprop"``); default ``"adam"``.
      loss: a Keras loss name (``"..._from_logits"`` for logits), a Keras loss object or a
        per-example callable; default ``"sparse_categorical_crossentropy"``.
      metrics: lockstep or Keras metric objects, names (``"accuracy"``, ...) or per-sample functions.
      strategy: default: the active scope's, else the one whose scope built the Keras model, else one device.
      seed: seeds a `FunctionalModel`'s initialisation and its `rng` keys.
      batch_statistics: ``"global"`` (default): Keras `BatchNormalization` uses the statistics of
        the real rows of the whole global batch (two small all-reduces per layer): the step is the
        one-device step. ``"per_replica"``: each replica's own rows, as TF's `MirroredStrategy`
        does — cheaper, but the step then depends on the number of replicas.
      gradient_accumulation_steps: one optimizer update per k batches: exactly one device's step on
        their samples together (see `lockstep.training._step_runner`); callbacks, `steps_per_epoch`,
        `global_step` and backups count updates.
      dtype_policy: ``"float32"``, ``"mixed_bfloat16"`` or ``"mixed_float16"`` for a `FunctionalModel`
        (a Keras model keeps its own policy).
      steps_per_execution: optimizer steps in one compiled call (Keras' name; default: a compiled
        Keras model's, else 1), each exactly the step taken alone; per-batch callbacks are called
        once a call, and `steps_per_epoch` / `validation_steps` / `steps` run in whole calls, as in
        Keras (5 at 3 a call: 6; see `lockstep.training._executions`).
      remat: activation checkpointing of the training step's forward pass: None (default), "full"
        (only the inputs kept, the whole forward pass computed again at once for the gradient:
        little memory saved, benchmarks/REMAT_GPU.md), "layers" (each
        of a Keras model's layers' outputs kept, their insides computed again), "dots" (matrix
        products kept, MaxText's "save dots"), "offload" (those moved to host memory) or a JAX
        checkpoint policy's name; the numbers are the same.
    """

    #: how the trainer drives `model`: ``model_adapter(model, seed, batch_statistics)``, an adapter
    #: (`lockstep.training._model`: `build`, `apply`, weights); a subclass sets a `staticmethod`
    model_adapter: Callable[[Any, int, str], Any] = staticmethod(adapt)
    #: what the trainer trains `model` with: ``model_settings(model, optimizer, loss, metrics,
    #: steps_per_execution)``, a `ModelSettings` (`lockstep.training._settings`: those given, else
    #: lockstep's defaults; a compiled Keras model's own in `lockstep.keras`'s subclass)
    model_settings: Callable[..., ModelSettings] = staticmethod(given_settings)
    #: each callback given to `fit` / `evaluate` / `predict` as the `Callback` that runs (as given
    #: here; `lockstep.keras`'s subclass wraps Keras callbacks)
    callback_adapter: Callable[[Any], Callback] = staticmethod(lambda callback: callback)

    def __init__(self, model: Any, optimizer: str | optax.GradientTransformation | None = None,
                 loss: str | Callable[..., Any] | None = None, metrics: Iterable[Metric | str | Callable[..., Any]] | None = None,
                 strategy: Strategy | None = None, seed: int = 0, batch_statistics: str = "global",
                 gradient_accumulation_steps: int = 1, dtype_policy: str | None = None,
                 steps_per_execution: int | None = None, remat: str | None = None):
        self._accumulation = checked_accumulation(gradient_accumulation_steps)
        self.remat = checked_remat(remat)
        self.seed = seed
        if steps_per_execution is not None:  # checked before the model is read, as every argument is
            checked_steps_per_execution(steps_per_execution)
        checked_batch_statistics(batch_statistics)
        self.strategy = _strategy_for(model, strategy)
        self.model = model
        self._engine = self.strategy.extended
        self._adapter = self.model_adapter(model, seed, batch_statistics)
        settings = self.model_settings(model, optimizer, loss, metrics, steps_per_execution)
        optimizer, loss, metrics, self.steps_per_execution = settings[:4]
        self._optimizer = self._adapter.optimizer(optimizer)
        self.dtype_policy = resolve_policy(dtype_policy, self._adapter.dtype_policy())
        if self.dtype_policy == "mixed_float16" and settings.loss_scaling:  # unless Keras' compile left it out
            self._optimizer = self._optimizer.scaled()
        # what backups call each array
        self._names = functools.partial(state_names, self._adapter.variable_names, self._optimizer)
        self._loss_fn = _losses.get(loss)
        self._labels = LabelCheck(loss)  # labels checked on the host against a named loss
        self._inputs = InputCheck(lambda p, x: self._layout.on_stored(self._adapter.apply)(p, x, False)[0],
                                  self._adapter.check_input)
        self._loss_tracker, self._metrics, self._all = _metric_collections(metrics)
        self._runner: StepRunner | None = None  # the compiled steps, once the model is built
        self._layout: Replicated = Replicated(self._engine, self._optimizer.transformation)  # where the state lies, once built
        self._laid_out = False  # whether `_layout` is the model's (laid out once, from its variables)
        self.layouts: Any = None  # a sharded strategy's `ShardingPlan` of the variables, once built
        self.stop_training, self.history = False, None  # history: the last fit's `History`
        self.stop_evaluating = self.stop_predicting = False  # a callback's, in a batch of evaluate / predict
        self.last_logs: dict[str, Any] | None = None  # the loss and metrics of the last epoch or evaluation ended
        self.log_skipped_steps = True  # mixed_float16: the epoch's logs count the steps skipped (not Keras' fit's)
        self._state: TrainState | None = None  # the training state, replaced at each step; None until built
        self._losses_checked = False  # the model's own `add_loss` terms (`check_batch_losses`)
        self._resume: TrainState | None = None  # a restored state, whose position the next fit takes up
        self._stream, self._callbacks = None, []  # the last fit's data and callbacks, for `train_state`
        self._cblist: CallbackList | None = None  # the last fit's, for `fit_counters`

    # --- building ------------------------------------------------------------------------
    def _build(self, batch: Any, arg: str, labels: Any = None, labels_arg: str | None = None, losses: bool = True,
               place: bool = True) -> Callable[[Any, str], None]:
        """Builds the model on `batch` (the first of `arg`), checks that it takes it, and returns
        the check of `arg`'s later batches. The metrics are built from its labels once all of
        `labels` (`labels_arg`'s arrays, where given) are checked: labels a fit refuses build nothing.
        Without `place`, a new state is left abstract (`_initial_state`)."""
        x, y, _ = unpack(batch)
        x = jax.tree.map(np.asarray, x)
        self._adapter.check_unchanged()
        if self._state is None:
            self._initial_state(self._adapter.build(x), place)
        self._inputs.check(self._state.params, x, arg)
        if y is not None and (not self._all.built or self._labels.needs_classes):
            pred_shape = output_shape(self._adapter, self._state.params, x, self._layout.on_stored(self._adapter.apply))
            self._labels.set_classes(pred_shape)
            if self._labels.kind is not None and labels is not None:  # arrays: alike on every worker
                self._labels.check(labels, labels_arg or arg)
            self._all.build(shapes_of(y), pred_shape)
        if y is not None:  # (a metric such as "mae" needs no shapes: lockstep's are built before Keras' are)
            getattr(self._adapter, "build_compiled", lambda *_: None)(x, y, self._optimizer)
        if losses and not self._losses_checked:  # fit / evaluate, which add the model's own losses
            getattr(self._adapter, "check_batch_losses", lambda *_: None)(x, self.strategy.num_replicas_in_sync)
            self._losses_checked = True
        if self._runner is None:
            apply = in_precision(self._adapter.apply, self.dtype_policy, isinstance(self.model, FunctionalModel))
            self._runner = StepRunner(self._engine, make_steps(
                self._layout.on_stored(apply), self._loss_fn, self._loss_tracker, self._metrics,
                self.strategy.num_replicas_in_sync, self.remat, self._adapter.layers_named), self._layout)
        return lambda x, where: self._inputs.check(self._state.params, x, arg, where)

    def _build_on(self, data: Any, arg: str, labels: Any = None, labels_arg: str | None = None,
                  metrics: bool = True) -> Callable[[Any, str], None]:
        """`_build` on `data`'s first batch; once the model (and, with `metrics`, its metrics) is
        built, data whose reads run the user's code (`user_reads`: a `PyDataset`) is not read
        ahead, as Keras' loops do not read it: its batches are checked as they pass."""
        if getattr(data, "user_reads", False) and self._runner is not None and (
                not metrics or (self._all.built and not self._labels.needs_classes)):
            self._adapter.check_unchanged()
            self._require_built()  # (a state compiled ahead of time, `step_memory`, is placed now)
            return lambda x, where: self._inputs.check(self._state.params, x, arg, where)
        return self._build(first_batch(data), arg, labels, labels_arg, losses=metrics)

    def _initial_state(self, params: Any, place: bool = True) -> None:
        """The state a new model starts from, laid out as the strategy says (once); without `place`,
        its shapes where they would lie (`abstract_state`: nothing placed), for a program compiled
        ahead of time."""
        if not self._laid_out:
            self._layout = self._optimizer.layout(self._engine, params, self._adapter.paths(params))
            self.layouts = self._layout.plan  # a sharded strategy's `ShardingPlan` (`.report()`); None: replicated
            self._laid_out = True
        if place:
            self._built_state(initial_state(self._layout, params, self._names))
        else:
            self._state = TrainState(*self._layout.abstract_state(params), metric_state=None, epoch=0, step=0,
                                     global_step=0, seed=0, callbacks={})

    def get_metric(self, name: str) -> Metric | None:
        """The metric logged under `name` (``"loss"`` included), or None."""
        return self._all.metrics.get(name)

    @property
    def metrics_names(self) -> list[str]:
        return list(self._all.metrics)

    def _fresh_state(self) -> Any:
        return self._engine.per_replica_copies(self._all.init())

    # --- training state ------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken by the current (or last) `fit`."""
        return 0 if self._state is None else self._state.global_step

    @property
    def train_state(self) -> TrainState:
        """The whole training state (weights, optimizer, metric states, position, callbacks): in `fit`, the last step's.

        In the variables' own shapes: a sharded strategy's padded variables are cut on the devices,
        so with several workers every worker asks for it at one point (as for `get_weights`). Its
        arrays are copies where they would be the trainer's own, which its next step takes over."""
        return own_state(self._state, self.current_state())

    def current_state(self) -> TrainState:
        """`train_state` not copied: arrays the next step takes over (read them, or copy, before it)."""
        self._require_built()
        return snapshot(self._layout.unpadded(self._state), self._callbacks, self._stream)

    def shared_train_state(self, copy: bool = True) -> TrainState:
        """`train_state` with every worker's data checksum and iterator state: a collective, which
        every worker calls at the same step (as `BackupAndRestore` does); `copy=False` as `current_state`."""
        self._require_built()
        state = snapshot(self._layout.unpadded(self._state), self._callbacks, self._stream, share=True)
        return own_state(self._state, state) if copy else state

    def restore(self, state: TrainState) -> None:
        """Puts `state` (from `train_state`, or a checkpoint of it) back.

        Weights and optimizer state take effect at once; the position (epoch, step, the epoch's
        metric state, the seed) and the callbacks' states are taken up by the next `fit`, or by the
        current one when called from `on_train_begin`, once every callback has begun.

        Raises:
          TypeError: `state` is not a `TrainState`.
          ValueError: its weights do not fit this trainer's model and optimizer.
        """
        self._require_built()
        self._resume = placed(self._engine, self._layout, self._all, self._state, state)
        self._state = self._state.replace(params=self._resume.params, opt_state=self._resume.opt_state)

    # --- fit -------------------------------------------------------------------------------
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: int | str = "auto", callbacks: Iterable[Callback] | None = None,
            validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True, seed: int | None = 0,
            class_weight: dict[int, float] | None = None, sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int | list[int] = 1) -> History:
        """Trains for `epochs` epochs; returns the `History` (one entry per epoch and log name).

        `batch_size` is global (all replicas). `x` may be arrays (with `y`, `sample_weight`) or an
        iterable of batches ``(x, y)`` / ``(x, y, sample_weight)``. Validation runs after the epochs
        `validation_freq` names (as in Keras), on `validation_steps` batches at most; `class_weight`
        weighs the training samples only (Keras' validation loss does not see it). With `shuffle`,
        each pass's order derives from `seed` and the pass; `seed=None` draws the order of arrays
        from NumPy's global random state as the pass begins, as Keras' `fit` does (worker 0's).

        Raises:
          ValueError: `x` and `y` of different lengths, `validation_split` outside [0, 1), ...
        """
        _check_fit_args(epochs, validation_split, steps_per_epoch, verbose)
        agree_on("the settings of fit", lambda: fit_settings(self, dict(  # several workers: alike, before any step
            epochs=epochs, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch, batch_size=batch_size,
            shuffle=shuffle, seed=seed, class_weight=class_weight, validation_split=validation_split,
            validation_freq=validation_freq, validation_steps=validation_steps, validation_batch_size=validation_batch_size,
            gradient_accumulation_steps=self._accumulation, model_seed=self.seed)))
        note_weighted_metrics(sample_weight, self._metrics)
        if validation_split:
            x, y, sample_weight, validation_data = split_validation(x, y, sample_weight, validation_split, validation_data)
        train = to_batches(self.strategy, x, y, class_weighted(y, sample_weight, class_weight), batch_size, shuffle, seed)
        val = validation_batches(self.strategy, validation_data, validation_batch_size or batch_size, validation_freq,
                                 validation_steps)
        inputs = self._build_on(train, "x", y, "y" if y is not None else "x")
        if val is not None:  # its inputs checked now, not after an epoch has trained
            self._build_on(val.batches, "validation_data", validation_labels(validation_data))
        cbs, params = _fit_callbacks(list(map(self.callback_adapter, callbacks or [])), verbose, train, epochs, steps_per_epoch, self._accumulation)
        train = checked(train, self._labels, y, "y" if y is not None else "x", inputs)
        checked(IterableBatches(()), self._labels, validation_labels(validation_data), "validation_data")  # arrays: now, not after an epoch
        history = self.history = History()
        cbs.append(history)
        cblist = CallbackList(cbs, self, params)
        self.stop_training = False
        self._stream = DataStream(self._engine, train, whole_calls(steps_per_epoch, self.steps_per_execution),
                                  self._accumulation, initial_epoch, epochs=epochs)
        self._callbacks, self._cblist = cblist.callbacks, cblist
        self._state = fit_start(self._state, initial_epoch, seed, self._fresh_state(), train.batch_size, self._accumulation)
        logs: dict[str, Any] = {}
        try:
            cblist.on_train_begin()
            if self._resume is not None:  # restored before fit or in on_train_begin: taken up once all have begun
                self._state, self._resume = take_up(self._resume, self._state, self._stream, self._callbacks), None
            self.lend_state()
            for epoch in range(self._state.epoch, epochs):
                logs = self._fit_epoch(epoch, self._stream, val, cblist)
                if self.stop_training:
                    break
            cblist.on_train_end(logs)
        finally:  # on any exit the model keeps the weights of the last completed step, as in Keras
            self._callbacks, self._lending = [], False  # (given copies, no longer lent the state)
            self._loop_ends()  # (an epoch cut short: its last batch's state may be gone)
            self._stream.close()
            try:
                self.sync_model()
            finally:
                cblist.on_train_exit()
        return history

    def _fit_epoch(self, epoch: int, train: DataStream, val: Validation | None, cblist: CallbackList
                   ) -> dict[str, Any]:
        """One epoch (from step `self._state.step` on, after a resume); returns the epoch's logs."""
        skip = self._state.step
        self._loop_begins(self._state.metric_state if skip else None, training=True, watch=cblist.watches)
        if not skip:  # (before the hook: what a callback changes there is the epoch's start, as in Keras)
            self._state = self._state.replace(metric_state=self._fresh_state())
        cblist.on_epoch_begin(epoch)
        for step, execution in executions(train.epoch(epoch, skip), self._accumulation, self.steps_per_execution, skip):
            cblist.on_train_batch_begin(step)
            self._take_pending()  # (what callbacks changed in the metric objects, as Keras' loops reread them)
            self._state = self._runner.run(self._state, execution, keep=functools.partial(setattr, self, "_state"))
            self.keep_lent_current()
            logs = self._batch_logs(self._state.metric_state, cblist.reads["on_train_batch_end"])
            cblist.on_train_batch_end(step + len(execution) - 1, logs)
            if self._stops_after_call(cblist):
                break
        else:
            train.ended()
        self._loop_settles(cblist.stops_in_batches)
        self._state = self._state.replace(epoch=epoch + 1, step=0)
        logs = self._ended(self._state.metric_state)
        self.last_logs = dict(logs)
        if (skipped := skipped_steps(self._state.opt_state)) is not None and self.log_skipped_steps:
            logs["skipped_steps"] = skipped  # mixed_float16: steps skipped for non-finite gradients so far
        if val is not None and val.due(epoch):
            logs.update({f"val_{k}": v for k, v in self._evaluate_batches(val.batches, cblist, steps=val.steps)[0].items()})
        cblist.on_epoch_end(epoch, logs := dict(sorted(logs.items())))  # Keras' callbacks get the names sorted
        self.stop_training = agreed(self.stop_training)
        return logs
