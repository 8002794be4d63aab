"""Keras' own `model.fit` / `evaluate` / `predict` on a model of a lockstep strategy, run by a
`Trainer` (the same exact engine), with Keras' signatures and return values.

`lockstep.keras.install` puts these on `keras.Model`: a model built in a lockstep
strategy's scope (as TF users write it: build and compile in the scope, `fit` anywhere), or
called inside one, trains through lockstep; any other model runs Keras' own methods untouched.
The Trainer is kept with the model and made anew when the model is compiled again, so seed 004's
code runs with only the import and strategy lines changed:

>>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
'jax'
>>> import keras, numpy as np, lockstep as ls
>>> strategy = ls.MirroredStrategy(4)
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
>>> x, y = np.random.default_rng(0).normal(size=(10, 3)).astype("float32"), np.arange(10) % 2
>>> sorted(model.fit(x, y, batch_size=4, epochs=2, verbose=0).history)
['accuracy', 'loss']
>>> len(model.evaluate(x, y, verbose=0)), model.predict(x, verbose=0).shape
(2, (10, 2))

`train_on_batch` is one `fit` step on one global batch, `test_on_batch` an `evaluate` of it and
`predict_on_batch` a `predict` (each reports that batch's numbers, as Keras 3 resets its metrics
before each); arguments lockstep does not take are refused before Keras touches the model.
"""

from __future__ import annotations

import collections.abc
import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ..callbacks import Callback
from ..data import DataAdapter, PyDatasetBatches, adapt
from ..distribute import remember_scope, strategy_of_model
from ..engine import host_value, spread
from ..training import Validation, class_weighted, is_arrays, to_batches
from ._model_files import whole_on_host, writing
from ._trainer import Trainer

_ORIGINAL: dict[str, Any] = {}
_HELD = "_lockstep_trainer"  # the model's attribute holding (key, Trainer): they live and die together
_RUNNING = "_lockstep_running"  # (strategy, trainer) while the model's `fit` or `evaluate` runs


def _fingerprint(model: Any) -> tuple[int, ...]:
    """The identity of the arrays the model's (and its optimizer's) variables hold: it changes
    when anything other than this trainer assigns them (another Trainer, `set_weights`, `load_weights`)."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables) + list(getattr(optimizer, "variables", None) or [])
    return tuple(id(v.value) for v in variables)


def install(keras: Any) -> None:
    """Routes `keras.Model`'s fit / evaluate / predict (and the `*_on_batch` methods) of models of
    a lockstep strategy through lockstep, and has a model made in a lockstep scope keep its
    strategy (`remember_scope`) (once per process)."""
    if _ORIGINAL:
        return
    for name, method in (("__init__", _init), ("fit", _fit), ("evaluate", _evaluate), ("predict", _predict),
                         ("predict_on_batch", _predict_on_batch), ("train_on_batch", _train_on_batch),
                         ("test_on_batch", _test_on_batch), ("get_weights", _get_weights),
                         ("get_metrics_result", _get_metrics_result), ("reset_metrics", _reset_metrics),
                         ("save", _written("save")), ("save_weights", _written("save_weights"))):
        _ORIGINAL[name] = getattr(keras.Model, name)
        method.__doc__ = _ORIGINAL[name].__doc__
        setattr(keras.Model, name, method)


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    _ORIGINAL["__init__"](self, *args, **kwargs)
    remember_scope(self)


def _get_weights(self: Any) -> list[Any]:
    """Keras' `get_weights`; variables whose shards other workers hold (a `ShardedStrategy` mesh
    spanning workers) are gathered from them (every worker calls it, as it calls `fit`)."""
    if not any(spread(v.value) for v in self.weights):
        return _ORIGINAL["get_weights"](self)
    return [host_value(v.value) for v in self.weights]


def _written(name: str) -> Any:
    """Keras' writing method `name` (`save`, `save_weights`), called by every worker of a job, as
    in TF: worker 0 alone writes the file (variables whose shards other workers hold are gathered
    by all first), and every worker returns once it is written (a worker that loads it next, as
    TF's multi-worker tutorial does, finds it whole)."""
    def write(self: Any, filepath: Any, *args: Any, **kwargs: Any) -> None:
        if writing():  # inside lockstep's own write (`Trainer.save`), which decided who writes
            return _ORIGINAL[name](self, filepath, *args, **kwargs)
        with whole_on_host(self) as writes:
            if writes:
                _ORIGINAL[name](self, filepath, *args, **kwargs)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"lockstep: keras {name}")
    return write


def _compiled(model: Any) -> None:
    if not model.compiled:
        raise ValueError("You must call `compile()` before using the model.")  # Keras' own words


def _built_as_keras(model: Any, strategy: Any, x: Any, y: Any, batch_size: Any, predicting: bool = False,
                    shuffle: Any = False) -> Any:
    """`x`, after a model without variables yet (a subclassed one makes them when first called) is
    built as Keras' loops build it, in `strategy`'s scope: from the first batch's shapes, with its
    compiled loss, metrics and optimizer (`predicting`: its layers alone, by a call on the batch).
    Data other than arrays is read through the adapter the Trainer then takes in its place (a
    generator's first batch is not lost; `shuffle` as `fit` gives it)."""
    if x is None or (model.variables and all(layer.built for layer in model._flatten_layers())):
        return x  # (a layer may make variables unbuilt: Dropout's seed state, in a subclassed model's __init__)
    if is_arrays(x):
        first = jax.tree.map(lambda a: np.asarray(a)[:32 if batch_size is None else batch_size],
                             (x,) if y is None else (x, y))
    else:
        if y is None:  # (with `y`, the Trainer refuses it as Keras does)
            x = to_batches(strategy, x, None, None, batch_size, shuffle, None)
        first = x.first() if isinstance(x, DataAdapter) else None
        if first is None:
            return x
    with strategy.scope():
        if predicting:
            from keras.src.backend import StatelessScope

            with StatelessScope():
                model(first[0] if isinstance(first, tuple) else first)
        else:
            model._symbolic_build(data_batch=first)
    return x


def _one_output(model: Any, y: Any) -> Any:
    """`y` given as a one-element list or tuple for a model of one output, as Keras takes it: its element."""
    if isinstance(y, (list, tuple)) and len(y) == 1:
        try:
            outputs = model.outputs
        except (AttributeError, ValueError):  # a subclassed model: one output unless it says otherwise
            outputs = None
        if outputs is None or len(outputs) == 1:
            return y[0]
    return y


def _trainer(model: Any, strategy: Any, compiled: bool = True) -> Trainer:
    """The model's Trainer on `strategy`, made anew after another `compile` (an uncompiled model
    may predict, as in Keras)."""
    if compiled:
        _compiled(model)
    running = model.__dict__.get(_RUNNING)
    if running is not None and running[0] is strategy:  # a callback's evaluate / predict during fit or
        return running[1]  # evaluate: the trainer that runs (the weights lent to the model are its state's)
    key = _key(model, strategy)
    held = model.__dict__.get(_HELD)
    if held is None or held[0] != key:  # a new compile, or weights set from elsewhere: a Trainer that reads them
        held = (key, Trainer(model, strategy=strategy))
        held[1].log_skipped_steps = False  # Keras' logs hold no such entry
        object.__setattr__(model, _HELD, held)  # past Keras' attribute tracking
    return held[1]


@contextlib.contextmanager
def _running(model: Any, strategy: Any, trainer: Trainer) -> Iterator[None]:
    """`trainer` is the model's running one while its `fit` or `evaluate` runs: a callback's
    `evaluate` or `predict` runs on it (and the loop it is called in goes on from its metrics)."""
    outer = model.__dict__.get(_RUNNING)
    object.__setattr__(model, _RUNNING, (strategy, trainer))  # past Keras' attribute tracking
    try:
        yield
    finally:
        if outer is None:
            model.__dict__.pop(_RUNNING, None)
        else:
            object.__setattr__(model, _RUNNING, outer)


def _key(model: Any, strategy: Any) -> tuple[Any, ...]:
    """What a model's Trainer is made for: the strategy, the `compile` (each makes a new config), the
    trainable variables (`trainable` set anew) and, last, the arrays they hold (`_fingerprint`)."""
    return (strategy, model.compiled, id(getattr(model, "optimizer", None)), id(getattr(model, "_compile_config", None)),
            id(getattr(model, "_compile_metrics", None)), id(getattr(model, "loss", None)),
            tuple(id(v) for v in model.trainable_variables), _fingerprint(model))


def _ran(model: Any) -> None:
    """After a call: the model's arrays as this trainer left them."""
    held = model.__dict__.get(_HELD)
    if held is not None:
        object.__setattr__(model, _HELD, ((*held[0][:-1], _fingerprint(model)), held[1]))


def _unsupported(**given: Any) -> None:
    for name, (value, default) in given.items():
        if value != default:
            raise ValueError(f"`{name}` is not supported by lockstep's fit / evaluate yet, got {name}={value!r}: "
                             f"leave it at {default!r} (the numbers would otherwise differ from Keras').")


def _fit(self: Any, x: Any = None, y: Any = None, batch_size: Any = None, epochs: int = 1, verbose: Any = "auto",
         callbacks: Any = None, validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
         class_weight: Any = None, sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: Any = None,
         validation_steps: Any = None, validation_batch_size: Any = None, validation_freq: int = 1) -> Any:
    strategy = strategy_of_model(self, by_devices=False)
    if strategy is None:
        return _ORIGINAL["fit"](self, x, y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
                                validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
                                class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
                                steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                                validation_batch_size=validation_batch_size, validation_freq=validation_freq)
    _one_validation_of(validation_data, validation_freq, range(initial_epoch, epochs))
    _compiled(self)
    y = _one_output(self, y)
    x = _as_keras_starts(self, x, y, sample_weight, batch_size, shuffle, validation_split, validation_data)
    x = _built_as_keras(self, strategy, x, y, batch_size, shuffle=shuffle)
    trainer = _trainer(self, strategy)
    validation_data = _validated_as_keras(self, validation_data)
    callbacks = [*(callbacks or []), _KerasModelHistory(self)]
    epochs, steps_per_epoch, validation_steps = _limited(epochs, steps_per_epoch, validation_steps)
    try:
        with _running(self, strategy, trainer):
            self.history = trainer.fit(
                x, y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
                validation_split=validation_split, validation_data=validation_data, shuffle=shuffle, seed=None,
                class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                validation_batch_size=validation_batch_size, validation_freq=validation_freq)
        self.history.set_trainer(self)  # `history.model` is the Keras model, as in Keras
        return self.history  # Keras keeps the last fit's History on the model
    finally:
        self.stop_training = trainer.stop_training  # as Keras leaves it: True after a callback stopped the fit
        _ran(self)


def _unbuilt(model: Any, compiled: bool = True) -> bool:
    """Whether Keras' loops would build the model (`compiled`: or its compiled loss or metrics, as
    `fit` and `evaluate` do; `predict` builds the layers alone) on a first batch."""
    parts = (getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None)) if compiled else ()
    return not all(layer.built for layer in model._flatten_layers()) or any(c is not None and not c.built
                                                                           for c in parts)


def _as_keras_starts(model: Any, x: Any, y: Any, sample_weight: Any, batch_size: Any, shuffle: Any,
                     validation_split: float = 0.0, validation_data: Any = None) -> Any:
    """`x` for lockstep's loop after what Keras' `fit` (or `evaluate`, `shuffle` False) does before
    its own: on an unbuilt model (`_unbuilt`) it builds on the first batch of a pass it then leaves,
    which for arrays with `shuffle` draws that pass's permutation (`"batch"`: its first batch's)
    from NumPy's global random state all the same; a `keras.utils.PyDataset` is read as Keras reads it (`PyDatasetBatches.keras_start`:
    that pass, then `on_epoch_end` before every loop; its batches shuffled from Python's global
    random state). So the passes that train begin (`fit(seed=None)`) where Keras' begin."""
    if PyDatasetBatches.accepts(x):
        x = adapt(x, y, sample_weight, batch_size, bool(shuffle), None)  # "batch": shuffled, as in Keras
        x.keras_start(_unbuilt(model))
    elif is_arrays(x) and shuffle and _unbuilt(model):
        n = len(jax.tree.leaves(x)[0])
        split = validation_split if validation_data is None else 0.0  # Keras splits only without validation_data
        n = int(math.floor(n * (1.0 - split))) if split else n
        np.random.permutation(min(32 if batch_size is None else batch_size, n) if shuffle == "batch" else n)
    return x


def _validated_as_keras(model: Any, validation_data: Any) -> Any:
    """`validation_data` as Keras' fit takes it: its `y` a one-element list for a model of one output
    (`_one_output`); a `keras.utils.PyDataset` that each validation ends the previous pass of again
    first (`PyDatasetBatches.ends_before_each_pass`)."""
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        return (validation_data[0], _one_output(model, validation_data[1]), *validation_data[2:])
    if not PyDatasetBatches.accepts(validation_data):
        return validation_data
    data = adapt(validation_data, seed=None, arg="validation_data")
    data.ends_before_each_pass = True
    return data


def _one_validation_of(validation_data: Any, validation_freq: Any, epochs: range) -> None:
    """Refuses a one-shot iterator (a generator) as `validation_data` that several of `epochs`
    validate on: Keras keeps its first 2 batches, so each later validation reads those again and
    then what is left of it, where lockstep's reads on (other numbers)."""
    if not isinstance(validation_data, collections.abc.Iterator):
        return
    due = sum(map(Validation([], validation_freq, None).due, epochs))
    if due > 1:
        raise ValueError(
            f"`validation_data` is a one-shot iterator (a generator) and {due} epochs validate on it: Keras' fit "
            "keeps its first 2 batches, so every later validation reads those again before what is left of it, "
            "where lockstep's reads on: the numbers would differ. Give data that can be read again (arrays, a "
            "keras.utils.PyDataset, a tf.data.Dataset, a list of batches), or validate once (`validation_freq`).")


class _KerasModelHistory(Callback):
    """`model.history` as Keras sets it: the running fit's `History`, from the fit's start."""

    stops_in_batches = False

    def __init__(self, model: Any):
        super().__init__()
        self._keras_model = model

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._keras_model.history = self.trainer.history if self.trainer is not None else None


def _evaluate(self: Any, x: Any = None, y: Any = None, batch_size: Any = None, verbose: Any = "auto",
              sample_weight: Any = None, steps: Any = None, callbacks: Any = None, return_dict: bool = False,
              **kwargs: Any) -> Any:
    strategy = strategy_of_model(self, by_devices=False)
    if strategy is None:
        return _ORIGINAL["evaluate"](self, x, y, batch_size=batch_size, verbose=verbose, sample_weight=sample_weight,
                                     steps=steps, callbacks=callbacks, return_dict=return_dict, **kwargs)
    _unsupported(**{k: (v, None) for k, v in kwargs.items()})
    _, steps = _limited(None, steps)
    try:
        _compiled(self)
        y = _one_output(self, y)
        x = _as_keras_starts(self, x, y, sample_weight, batch_size, False)
        x = _built_as_keras(self, strategy, x, y, batch_size)
        trainer = _trainer(self, strategy)
        with _running(self, strategy, trainer):
            logs = trainer.evaluate(x, y, batch_size=batch_size, sample_weight=sample_weight, verbose=verbose,
                                    callbacks=callbacks, return_dict=True, steps=steps)
    finally:
        _ran(self)
    return _in_order(logs, return_dict)  # Keras' order: the loss, then the metrics


def _predict(self: Any, x: Any, batch_size: Any = None, verbose: Any = "auto", steps: Any = None,
             callbacks: Any = None) -> Any:
    strategy = strategy_of_model(self, by_devices=False)
    if strategy is None:
        return _ORIGINAL["predict"](self, x, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks)
    _, steps = _limited(None, steps)
    try:
        if PyDatasetBatches.accepts(x):  # Keras reads a first batch only to build an unbuilt model
            x = adapt(x, batch_size=batch_size, seed=None)
            x.keras_start(_unbuilt(self, compiled=False), end=False)
        x = _built_as_keras(self, strategy, x, None, batch_size, predicting=True)
        trainer = _trainer(self, strategy, compiled=False)
        return trainer.predict(x, batch_size=batch_size, verbose=verbose, callbacks=callbacks,
                               steps=steps)
    finally:
        _ran(self)


def _predict_on_batch(self: Any, x: Any) -> Any:
    strategy = strategy_of_model(self, by_devices=False)
    if strategy is None:
        return _ORIGINAL["predict_on_batch"](self, x)
    try:
        return _trainer(self, strategy, compiled=False).predict(x, batch_size=len(jax.tree.leaves(x)[0]), verbose=0)
    finally:
        _ran(self)


def _limited(epochs: Any, *steps: Any) -> tuple[Any, ...]:
    """`epochs` and each loop's `steps` as Keras' own loops take them under its debugging limits,
    `keras.config.set_max_epochs` / `set_max_steps_per_epoch` (with Keras' warnings)."""
    import warnings

    from keras import config

    most = getattr(config, "max_epochs", lambda: None)()  # (Keras 3.8 has neither limit)
    if epochs is not None and most and most < epochs:
        warnings.warn(f"Limiting epochs to {most}", stacklevel=3)
        epochs = most
    limit = getattr(config, "max_steps_per_epoch", lambda: None)()
    return (epochs, *(limit if limit and (not s or limit < s) else s for s in steps))


def _get_metrics_result(self: Any) -> Any:
    """Keras' `get_metrics_result`: the loss and metrics of the last loop run (an epoch, or the
    evaluation after it), from the trainer that ran it, or in a loop its metric objects as of its
    last batch (`keras_metrics_current`); after another `compile`, Keras' own (its new metrics:
    unbuilt until a loop runs)."""
    held, strategy = self.__dict__.get(_HELD), strategy_of_model(self, by_devices=False)
    if held is not None:
        held[1].keras_metrics_current()  # (in a loop: its metric objects as of its last batch)
    if (held is None or held[1].last_logs is None or strategy is None
            or held[0][:-1] != _key(self, strategy)[:-1]):  # compiled since: Keras' fresh metrics
        return _ORIGINAL["get_metrics_result"](self)
    return dict(held[1].last_logs)


def _reset_metrics(self: Any) -> None:
    """Keras' `reset_metrics`; `get_metrics_result` then reads the metric objects reset, as in Keras
    (not the last loop's logs), and in a loop in progress its metrics start again from its next
    step where a callback synced the model's state since its last steps, as in Keras' loops
    (`Trainer.keras_model_reset`)."""
    held = self.__dict__.get(_HELD)
    if held is None:
        return _ORIGINAL["reset_metrics"](self)
    held[1].keras_model_reset()  # (its objects and the model's, without Keras' broadcast from worker 0)


def _in_order(logs: dict[str, Any], return_dict: bool) -> Any:
    """Logs as Keras returns them: the dict (by name), or the values in order (a lone loss as a scalar)."""
    if return_dict:
        return dict(sorted(logs.items()))
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def _train_on_batch(self: Any, x: Any, y: Any = None, sample_weight: Any = None, class_weight: Any = None,
                    return_dict: bool = False) -> Any:
    strategy = strategy_of_model(self, by_devices=False)
    if strategy is None:
        return _ORIGINAL["train_on_batch"](self, x, y, sample_weight=sample_weight, class_weight=class_weight,
                                           return_dict=return_dict)
    if class_weight is not None and sample_weight is not None:
        raise ValueError("Arguments `sample_weight` and `class_weight` cannot be specified at the same time.")
    y = _one_output(self, y)
    try:
        trainer = _trainer(self, strategy)
        trainer.fit(x, y, batch_size=len(jax.tree.leaves(x)[0]), epochs=1, shuffle=False, verbose=0,
                    sample_weight=class_weighted(y, sample_weight, class_weight))
    finally:
        _ran(self)
    return _in_order(dict(trainer.last_logs or {}), return_dict)  # the loss first: Keras' order of a list


def _test_on_batch(self: Any, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False) -> Any:
    strategy = strategy_of_model(self, by_devices=False)
    if strategy is None:
        return _ORIGINAL["test_on_batch"](self, x, y, sample_weight=sample_weight, return_dict=return_dict)
    y = _one_output(self, y)
    try:
        logs = _trainer(self, strategy).evaluate(x, y, batch_size=len(jax.tree.leaves(x)[0]), verbose=0,
                                                 sample_weight=sample_weight, return_dict=True)
    finally:
        _ran(self)
    return _in_order(logs, return_dict)
