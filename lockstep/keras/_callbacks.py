"""`KerasCallback`: a `keras.callbacks.Callback` (built-in or a user's subclass) run by
`lockstep.Trainer`'s `fit` / `evaluate` / `predict` (`adapt_callback`), seeing a model that behaves as the Keras model does in Keras' own
`fit`.

The callback's `self.model` is a view of the Keras model whose training-time state is the
trainer's: `stop_training` is the trainer's (every worker stops where any asks: at an epoch's end,
or after the call of steps where a callback may stop within the epoch),
`optimizer.learning_rate` reads and sets the trainer's learning rate (no recompilation),
`get_weights` / `set_weights` are the trainer's weights (Keras' order), and `save` /
`save_weights` write the trained weights and optimizer state, from worker 0 only (every worker
gathers the shards of a model whose variables are split over the workers). Callbacks that
only write (`CSVLogger`, `TensorBoard`, `ProgbarLogger`, `RemoteMonitor`) run on worker 0 only.
Any other attribute is the Keras model's own.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._errors import UsageError
from .._keras_kind import defined_in_keras
from ..callbacks import HOOKS, BackupAndRestore, Callback, TrainerView, is_chief
from ..engine import spread

#: set on a Keras callback object that took its model's metric objects (`_ModelView.metrics`)
READS_METRICS = "_lockstep_reads_metrics"
_STOPS = ("stop_training", "stop_evaluating", "stop_predicting")  # the trainer's: Keras' fit, evaluate, predict
_WRITERS = ("CSVLogger", "TensorBoard", "ProgbarLogger", "RemoteMonitor")
#: Keras' own callbacks that never set `model.stop_training` in a batch's hooks (EarlyStopping: at an epoch's end)
_NOT_STOPPING_IN_BATCHES = (*_WRITERS, "EarlyStopping", "History", "LearningRateScheduler", "ModelCheckpoint",
                            "ReduceLROnPlateau", "SwapEMAWeights")
_HOOKS = [name for name in HOOKS if name != "on_train_exit"]
_ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}  # Keras' own


def _keras_classes(obj: Any) -> list[type]:
    return [c for c in type(obj).__mro__ if c.__module__.startswith("keras")]


def overrides(callback: Any, hook: str) -> bool:
    """Whether the Keras `callback` overrides `hook` (or Keras' alias of it)."""
    classes = _keras_classes(callback)
    base = next((c for c in classes if c.__name__ == "Callback"), None) if classes else Callback
    own = [hook] + ([_ALIASES[hook]] if hook in _ALIASES else [])
    given = getattr(callback, "__dict__", {})  # `keras.callbacks.LambdaCallback` sets its hooks on the instance
    return any(h in given or getattr(type(callback), h, None) is not getattr(base, h, None) for h in own)


def is_keras_callback(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 callback, a user's subclass included (Keras need not be imported)."""
    return any(c.__name__ == "Callback" for c in _keras_classes(obj)) and hasattr(obj, "set_model")


def adapt_callback(callback: Any) -> Any:
    """A callback given to `lockstep.Trainer`'s `fit` / `evaluate` / `predict` as a lockstep one: a
    Keras callback by `as_lockstep`, any other as given."""
    return as_lockstep(callback) if is_keras_callback(callback) else callback


class LiveValue:
    """A value of the trainer read as a Keras variable is (`.numpy()`, `float`, `int`, arithmetic,
    comparisons), and set with `.assign` where it may be: the optimizer's `learning_rate` and
    `iterations` as Keras' callbacks see them during lockstep's `fit`.

    >>> lr = LiveValue(lambda: 0.5, print)
    >>> float(lr * 2), lr.numpy().item(), bool(lr > 0.1)
    (1.0, 0.5, True)
    >>> lr.assign(0.25)
    0.25
    """

    def __init__(self, read: Any, write: Any = None, name: str = "value"):
        self._read, self._write, self.name = read, write, name

    def numpy(self) -> np.ndarray:
        return np.asarray(self._read())

    @property
    def value(self) -> np.ndarray:
        return self.numpy()

    def assign(self, value: Any) -> None:
        if self._write is None:
            raise AttributeError(f"a Keras callback may not assign the optimizer's `{self.name}` during lockstep's fit.")
        self._write(float(np.asarray(value)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.numpy() if dtype is None else self.numpy().astype(dtype)

    def __float__(self) -> float:
        return float(self._read())

    def __int__(self) -> int:
        return int(self._read())

    def __index__(self) -> int:
        return int(self._read())

    def __repr__(self) -> str:
        return f"<LiveValue {self.name}={self._read()!r}>"


def _delegated(op: str) -> Any:
    def apply(self: LiveValue, *others: Any) -> Any:
        return getattr(self.numpy(), op)(*(np.asarray(o) if isinstance(o, LiveValue) else o for o in others))
    return apply


for _op in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
            "__pow__", "__neg__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"):
    setattr(LiveValue, _op, _delegated(_op))


class _OptimizerView:
    """`model.optimizer` as Keras' callbacks use it: `learning_rate` (readable and assignable) and
    `iterations` are the trainer's, as they stand at this step."""

    def __init__(self, trainer: TrainerView):
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name: str) -> Any:
        if name == "learning_rate":
            schedule = self._schedule()
            if schedule is not None:  # Keras' value: the schedule at the optimizer's count
                return LiveValue(lambda: np.asarray(schedule(self._trainer.optimizer_iterations)),
                                 self._set_learning_rate, name)
            return LiveValue(lambda: self._trainer.learning_rate, self._set_learning_rate, name)
        if name == "iterations":  # Keras' count of updates (on from an earlier fit; skipped steps left out)
            return LiveValue(lambda: np.int64(self._trainer.optimizer_iterations), name=name)
        return getattr(getattr(self._trainer.model, "optimizer", None), name)

    def _schedule(self) -> Any:
        """The Keras optimizer's `LearningRateSchedule`, if it was made with one."""
        optimizer = getattr(self._trainer.model, "optimizer", None)
        rate = getattr(getattr(optimizer, "inner_optimizer", optimizer), "_learning_rate", None)  # (loss scaling's)
        return rate if any(c.__name__ == "LearningRateSchedule" for c in type(rate).__mro__) else None

    def _set_learning_rate(self, value: float) -> None:
        if self._schedule() is not None:  # Keras' own error and words
            raise TypeError("This optimizer was created with a `LearningRateSchedule` object as its `learning_rate` "
                            "constructor argument, hence its learning rate is not settable. If you need the learning "
                            "rate to be settable, you should instantiate the optimizer with a float `learning_rate` "
                            "argument.")
        self._trainer.learning_rate = value

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "learning_rate":
            raise AttributeError(f"a Keras callback may set the optimizer's learning_rate during lockstep's fit, "
                                 f"not {name!r}.")
        self._set_learning_rate(float(value))


def _logs_given(call: Any, indexed: bool) -> Any:
    """`call`, a Keras callback's hook, given a dict of logs where lockstep has none (`{}`, as
    Keras gives every hook), positionally after the epoch or batch number of `indexed` hooks."""
    @functools.wraps(call)
    def hook(*args: Any, **kwargs: Any) -> Any:
        n = 1 if indexed else 0
        logs = args[n] if len(args) > n else kwargs.pop("logs", None)
        return call(*args[:n], {} if logs is None else logs)
    return hook


class _ModelView:
    """The Keras model as a Keras callback sees it during lockstep's `fit`."""

    def __init__(self, trainer: TrainerView, owner: Any = None):
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "optimizer", _OptimizerView(trainer))
        object.__setattr__(self, "_owner", owner)  # the Keras callback whose `model` it is

    @property
    def metrics(self) -> list[Any]:
        """The model's metric objects, holding the loop's states as of its last batch, as in Keras'
        loops. From now on a user's callback has them given those before each of its hooks (in this
        and later loops), as it may keep them: a reduction read to the host (a wait for the step)."""
        if self._owner is not None:
            self._owner.__dict__[READS_METRICS] = True
        self._trainer.keras_metrics_current()
        return self._trainer.model.metrics

    def get_metrics_result(self) -> dict[str, Any]:
        """Keras' `get_metrics_result`: in a loop, its loss and metrics as of its last batch; else
        the last loop's of the trainer that runs the callback."""
        running = self._trainer.metrics_result()
        if running is None and self._trainer.last_logs is not None:
            running = dict(self._trainer.last_logs)
        return running if running is not None else self._trainer.model.get_metrics_result()

    def reset_metrics(self) -> None:
        """Keras' `reset_metrics`: the metric objects reset, and in a loop its loss and metrics
        start again from its next step, as in Keras' loops."""
        self._trainer.reset_metrics()

    def get_weights(self) -> Any:
        return self._trainer.get_weights()

    def set_weights(self, weights: Any) -> None:
        self._trainer.set_weights(weights)

    def save(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        self._write("save", filepath, *args, **kwargs)

    def save_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        self._write("save_weights", filepath, *args, **kwargs)

    def _write(self, how: str, *args: Any, **kwargs: Any) -> None:
        self._trainer.sync_model()
        # every worker calls Keras' save and save_weights, as lockstep routes them: worker 0 writes
        # (variables whose shards other workers hold gathered by all first), and all return once written
        getattr(self._trainer.model, how)(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The Keras model called on `args` (``self.model(x)``): in a user's hook its variables hold
        the weights of this step (`_with_variables`)."""
        return self._trainer.model(*args, **kwargs)

    def jax_state_sync(self) -> None:
        """Keras' `Callback.model` calls it on every access: the weights are read only when asked for;
        what callbacks assign to the metric objects from then on is the loop's (Keras' state sync)."""
        self._trainer.keras_metrics_synced()

    def __getattr__(self, name: str) -> Any:
        if name in _STOPS:
            return getattr(self._trainer, name)
        return getattr(self._trainer.model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _STOPS:
            setattr(self._trainer, name, bool(value))
        else:
            setattr(self._trainer.model, name, value)


#: What Keras' own callbacks count with (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, ...).
_KERAS_STATE = frozenset({"wait", "best", "best_epoch", "best_weights", "stopped_epoch", "cooldown_counter",
                          "epochs_since_last_save", "_batches_seen_since_last_saving", "_last_batch_seen",
                          "_current_epoch"})
_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    """`value` as a backup keeps it (JSON data, or a list of arrays), or `_NOT_PLAIN`.

    >>> _plain(np.float32(0.5)), _plain((1, [2.0, None])), _plain(print) is _NOT_PLAIN
    (0.5, [1, [2.0, None]], True)
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (float, np.floating, np.integer)) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item() if hasattr(value, "item") else value
    if isinstance(value, (list, tuple)) and value and all(isinstance(a, np.ndarray) and a.ndim for a in value):
        return [np.asarray(a) for a in value]  # say, EarlyStopping's best_weights
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items.values()) else items
    return _NOT_PLAIN


def as_lockstep(callback: Any) -> Callback:
    """A Keras callback as a lockstep one: `keras.callbacks.BackupAndRestore` becomes lockstep's
    `BackupAndRestore` with its arguments (Keras' saves the weights only; lockstep's also the
    optimizer, the metrics, the data position and the callbacks' states, on every worker: the
    resumed run equals the uninterrupted one), kept with the Keras object across `fit` calls;
    any other is wrapped in a `KerasCallback`."""
    if "BackupAndRestore" not in [c.__name__ for c in _keras_classes(callback)]:
        return KerasCallback(callback)
    ours = callback.__dict__.get("_lockstep_backup")
    if ours is None:
        ours = BackupAndRestore(callback.backup_dir, save_freq=callback.save_freq or "epoch",  # False: Keras' on interrupt
                                delete_checkpoint=callback.delete_checkpoint)
        callback.__dict__["_lockstep_backup"] = ours
    return ours


class KerasCallback(Callback):
    """A Keras callback object as a lockstep callback: the hooks it overrides are forwarded, its
    `model` is a view of the Keras model whose state is the trainer's (see the module docstring).

    `lockstep.Trainer`'s `fit`, `evaluate` and `predict` wrap Keras callbacks with it.

    A `keras.callbacks.BackupAndRestore` is not wrapped: `as_lockstep` gives lockstep's
    (`lockstep.callbacks.BackupAndRestore`, same arguments), which backs up the whole state.
    """

    def __init__(self, callback: Any):
        super().__init__()
        classes = _keras_classes(callback)
        names = [c.__name__ for c in classes]
        self.keras_callback = callback
        self._first: dict[str, int] = {}  # the first batch number of each loop's running call
        self.state_name = f"keras.{type(callback).__name__}"  # its bookkeeping's name in backups
        keras_own = all(defined_in_keras(c) for c in type(callback).__mro__[:-1])
        self.stops_in_batches = not (keras_own and type(callback).__name__ in _NOT_STOPPING_IN_BATCHES)
        #: a user's hooks (a subclass of a writer's too) may read the model's metric objects in any batch
        #: hook: the batch's logs are then reduced on every worker (`CallbackList.reads`)
        self.reads_metrics = not keras_own or "LambdaCallback" in names
        if any(n in _WRITERS for n in names) and not is_chief():
            return  # a callback that only writes files or prints: worker 0's job
        users = ((not keras_own or "LambdaCallback" in names)
                 and not any(n in _WRITERS for n in names))  # a writer runs on worker 0 alone: no collective
        for hook in _HOOKS:  # only the hooks it overrides (those of a batch's end cost a read of the logs a step)
            if overrides(callback, hook):
                call = _logs_given(getattr(callback, hook), "batch" in hook or "epoch" in hook)
                setattr(self, hook, functools.partial(self._with_variables, call) if users else call)
        for loop in ("train", "test", "predict"):  # batch numbers as Keras gives them
            if (end := f"on_{loop}_batch_end") in vars(self):
                begin = f"on_{loop}_batch_begin"
                setattr(self, begin, functools.partial(self._call_begins, loop, vars(self).get(begin)))
                setattr(self, end, functools.partial(self._numbered_as_keras, loop, vars(self)[end]))

    def _call_begins(self, loop: str, hook: Any, batch: int, logs: Any = None) -> Any:
        self._first[loop] = batch
        return None if hook is None else hook(batch, logs)

    def _numbered_as_keras(self, loop: str, hook: Any, batch: int, logs: Any = None) -> Any:
        """Keras numbers the end of a call of `steps_per_execution` batches as if the call were
        whole, the epoch's last, shorter call too: its first batch's number + steps_per_execution - 1."""
        first = self._first.get(loop, batch)
        return hook(max(batch, first + getattr(self.trainer, "steps_per_execution", 1) - 1), logs)

    def _with_variables(self, hook: Any, *args: Any, **kwargs: Any) -> Any:
        """A user's hook, which reads and assigns the Keras model's variables as in Keras' `fit`:
        they hold the current weights, and what it assigns is the next step's; what it changes in
        the metric objects since a sync, the loop's (Keras' loops reread them at the next steps)."""
        if self.keras_callback.__dict__.get(READS_METRICS):
            self.trainer.keras_metrics_current()
        with self.trainer.keras_variables_current():
            out = hook(*args, **kwargs)
        self.trainer.keras_metrics_taken()
        return out

    def set_trainer(self, trainer: TrainerView) -> None:
        super().set_trainer(trainer)
        callback = self.keras_callback
        if (getattr(callback, "histogram_freq", 0) or getattr(callback, "write_images", False)) and any(
                spread(v.value) for v in getattr(trainer.model, "variables", [])):
            raise UsageError(f"keras.callbacks.{type(callback).__name__}(histogram_freq=..., write_images=...) reads "
                             "every weight on worker 0 alone, but other workers hold shards of this model's "
                             "variables: leave histogram_freq=0 and write_images=False (the scalars are logged), "
                             "or use lockstep.callbacks.TensorBoard.")
        callback.set_model(_ModelView(trainer, callback))

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        self.keras_callback.set_params(params)

    def get_state(self) -> dict[str, Any]:
        """The Keras callback's bookkeeping, for lockstep's backups: the attributes Keras' own
        callbacks count with (`wait`, `best`, `best_weights`, `cooldown_counter`, ...), and a user
        subclass's public attributes that hold plain data (numbers, strings, lists of them, arrays)."""
        callback = self.keras_callback
        own = not type(callback).__module__.startswith("keras")
        out = {}
        for name, value in vars(callback).items():
            if name in _KERAS_STATE or (own and not name.startswith("_") and name not in ("params", "model")):
                plain = _plain(value)
                if plain is not _NOT_PLAIN:
                    out[name] = plain
        return out

    def set_state(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self.keras_callback, name, value)
