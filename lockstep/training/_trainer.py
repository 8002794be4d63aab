"""`Trainer`: Keras-style `fit` / `evaluate` / `predict` on any strategy, with exact numbers."""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import losses as _losses
from .._strategy import DistributedDataset, Strategy, get_strategy
from .._values import Mirrored, PerReplica, raw, raw_tree
from ..callbacks import BackupAndRestore, Callback, CallbackList, History, ProgbarLogger
from ..callbacks._callback import is_chief
from ..checkpoint import atomic_path, load_tree, save_tree
from ..data import Batches
from ..data import batches as make_batches
from ..metrics import Mean, Metric, MetricCollection
from ..metrics import get as get_metric
from ._model import adapt
from ._optimizers import find_hyperparams, get_optimizer
from ._steps import make_eval_step, make_predict_step, make_train_step, unpack


class _LazyLogs(Mapping[str, Any]):
    """Running logs that are read (one reduction of every state) only when a callback looks."""

    def __init__(self, read: Callable[[], dict[str, Any]]):
        self._read = read
        self._logs: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._logs is None:
            self._logs = self._read()
        return self._logs

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, raw_tree(tree))


def _to_python(v: Any) -> Any:
    a = np.asarray(raw(v))
    return float(a) if a.ndim == 0 else a


def _is_arrays(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) or (
        isinstance(x, Mapping) and all(isinstance(v, (np.ndarray, jax.Array)) for v in x.values()))


def _strategy_for(model: Any) -> Strategy:
    """The active scope's strategy; else, for a Keras model built in a scope, that scope's strategy."""
    from .._strategy import _RECENT, _SCOPES, strategy_of_devices

    if _SCOPES.stack:
        return _SCOPES.stack[-1]
    variables = getattr(model, "variables", None) or []
    if variables:
        sharding = getattr(getattr(variables[0], "value", None), "sharding", None)
        found = strategy_of_devices(sharding.device_set) if sharding is not None else None
        if found is not None:
            return found
    default = get_strategy()
    recent = [r() for r in _RECENT]
    if variables and any(st is not None and st.num_replicas_in_sync > 1 for st in recent):
        warnings.warn(
            "this Trainer runs on one device (no strategy given, no scope active, and the model was not built "
            "in a strategy's scope): pass `strategy=`, or create the Trainer inside `strategy.scope()`.",
            stacklevel=3)
    return default


def _check_takes_labels(metric: Metric) -> None:
    params = inspect.signature(metric.batch_state).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name != "sample_weight"]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(
            f"`metrics` holds {type(metric).__name__} `{metric.name}`, which takes `values`, not "
            "(y_true, y_pred); wrap a per-sample function in lockstep.metrics.MeanMetricWrapper instead.")


def _num_samples(x: Any) -> int:
    return int(np.shape(jax.tree.leaves(x)[0])[0])


class Trainer:
    """Trains, evaluates and predicts with a model on a strategy, Keras style.

    Every number it reports — losses, metrics, evaluation results, predictions, callback
    decisions — is the number one device would report on the whole data: batches are split
    across replicas with padding masks, and metric *states* are reduced, never metric values.

    Args:
      model: a Keras 3 model (JAX backend) or a `lockstep.FunctionalModel`.
      optimizer: an optax transformation or a name (``"adam"``, ``"adamw"``, ``"sgd"``, ``"rmsprop"``).
      loss: a Keras loss name (``"..._from_logits"`` for logits) or a per-example callable.
      metrics: `lockstep.metrics` objects, names (``"accuracy"``, ``"mse"``, ...) or per-sample functions.
      strategy: defaults to the active scope's strategy; outside any scope, to the strategy in whose
        scope the Keras model was built; else a one-device strategy.
      seed: seeds a `FunctionalModel`'s initialisation.

    >>> import jax, jax.numpy as jnp, numpy as np, lockstep as ls
    >>> model = ls.FunctionalModel(
    ...     init=lambda rng, x: {"w": jnp.zeros((x.shape[-1], 3)), "b": jnp.zeros(3)},
    ...     apply=lambda p, x, training=False: x @ p["w"] + p["b"])
    >>> x = np.random.default_rng(0).normal(size=(103, 4)).astype(np.float32); y = (x[:, 0] > 0).astype(int)
    >>> trainer = ls.Trainer(model, optimizer="sgd", loss="sparse_categorical_crossentropy_from_logits",
    ...                      metrics=["accuracy"], strategy=ls.MirroredStrategy(4))
    >>> history = trainer.fit(x, y, batch_size=16, epochs=3, verbose=0)
    >>> sorted(trainer.evaluate(x, y, batch_size=16))
    ['accuracy', 'loss']
    >>> trainer.predict(x, batch_size=16).shape
    (103, 3)
    """

    def __init__(self, model: Any, optimizer: str | optax.GradientTransformation = "adam",
                 loss: str | Callable[..., Any] = "sparse_categorical_crossentropy",
                 metrics: Iterable[Metric | str | Callable[..., Any]] | None = None,
                 strategy: Strategy | None = None, seed: int = 0):
        self.strategy = strategy or _strategy_for(model)
        if not isinstance(self.strategy, Strategy):
            raise TypeError(f"`strategy` must be a lockstep strategy, got {type(strategy).__name__}.")
        self.model = model
        self._adapter = adapt(model, seed)
        self._optimizer = get_optimizer(optimizer)
        self._loss_fn = _losses.get(loss)
        if metrics is not None and (isinstance(metrics, (str, Metric)) or not isinstance(metrics, Iterable)):
            raise TypeError(f"`metrics` must be a list of metrics or names, got {metrics!r}.")
        self._loss_tracker = Mean(name="loss")
        resolved = [get_metric(m) for m in (metrics or [])]
        for m in resolved:
            _check_takes_labels(m)
        self._all = MetricCollection([self._loss_tracker, *resolved])
        self._metrics = MetricCollection({k: m for k, m in self._all.metrics.items() if m is not self._loss_tracker})
        self._params: Any = None
        self._opt_state: Any = None
        self._steps: dict[str, Callable[..., Any]] = {}
        self.stop_training = False
        self.history: History | None = None
        self._global_step = 0
        self._fit_seed = seed
        self._progress: tuple[int, int, Any] = (0, 0, None)

    # --- building ------------------------------------------------------------------------
    def _place(self, params: Any) -> None:
        if jax.process_count() > 1:  # every worker starts from worker 0's weights
            from jax.experimental import multihost_utils

            params = jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(params))
        self._params = jax.device_put(params, self.strategy._replicated)
        self._opt_state = jax.device_put(self._optimizer.init(self._params["trainable"]), self.strategy._replicated)

    def _build(self, batch: Any) -> None:
        x, y, _ = unpack(batch)
        x = jax.tree.map(np.asarray, x)
        if self._params is None:
            self._place(self._adapter.build(x))
        if y is not None and not self._all.built:
            y_pred = jax.eval_shape(lambda p, x: self._adapter.apply(p, x, False)[0], self._params, x)
            self._all.build(np.shape(y), y_pred.shape)
        if not self._steps:
            apply = self._adapter.apply
            self._steps = {
                "train": make_train_step(apply, self._loss_fn, self._optimizer, self._loss_tracker, self._metrics,
                                         self.strategy.num_replicas_in_sync),
                "eval": make_eval_step(apply, self._loss_fn, self._loss_tracker, self._metrics),
                "predict": make_predict_step(apply),
            }

    def get_metric(self, name: str) -> Metric | None:
        """The metric logged under `name` (``"loss"`` included), or None."""
        return self._all.metrics.get(name)

    @property
    def metrics_names(self) -> list[str]:
        return list(self._all.metrics)

    # --- data ----------------------------------------------------------------------------
    def _batches(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool, seed: int,
                 arg: str = "x") -> Iterable[Any]:
        if x is None:
            raise ValueError(f"`{arg}` is required, got None.")
        if isinstance(x, DistributedDataset):
            if x._strategy is not self.strategy:
                raise ValueError(f"`{arg}` is a distributed dataset of another strategy than the trainer's.")
            if y is not None or sample_weight is not None:
                raise ValueError(f"when `{arg}` is a distributed dataset, `y` and `sample_weight` must be None.")
            return x
        if _is_arrays(x):
            n = _num_samples(x)
            arrays: list[Any] = [x]
            for name, a in (("y", y), ("sample_weight", sample_weight)):
                if a is None:
                    if name == "y" and sample_weight is not None:
                        raise ValueError("`sample_weight` needs `y`.")
                    continue
                a = np.asarray(a)
                if a.ndim == 0 or a.shape[0] != n:
                    raise ValueError(f"`{arg}` and `{name}` must have the same number of samples: `{arg}` has {n}, "
                                     f"`{name}` has {a.shape[0] if a.ndim else 'a scalar'}.")
                arrays.append(a)
            if batch_size is None:
                batch_size = 32
            return make_batches(tuple(arrays), batch_size, shuffle=shuffle, seed=seed)
        if isinstance(x, (str, bytes)) or not isinstance(x, Iterable):
            raise TypeError(f"`{arg}` must be arrays or an iterable of batches, got {type(x).__name__}.")
        if y is not None or sample_weight is not None:
            raise ValueError(f"when `{arg}` is an iterable of batches, `y` and `sample_weight` must be None "
                             "(each batch carries them).")
        return x

    @classmethod
    def _peek(cls, data: Iterable[Any]) -> tuple[Any, Iterable[Any]]:
        """The first batch, and `data` with that batch still in it (a one-shot iterator is chained)."""
        if isinstance(data, DistributedDataset):
            first, inner = cls._peek(data._dataset)
            return first, DistributedDataset(data._strategy, inner, data._per_worker)
        if hasattr(data, "iterate"):
            first = next(iter(data.iterate(0)), None)  # a lockstep Batches: re-iterable, no epoch consumed
        elif iter(data) is data:
            it = iter(data)
            first = next(it, None)
            data = itertools.chain([] if first is None else [first], it)
        else:
            first = next(iter(data), None)
        if first is None:
            raise ValueError("the data yields no batch.")
        return first, data

    def _distribute(self, data: Iterable[Any]) -> DistributedDataset:
        return data if isinstance(data, DistributedDataset) else self.strategy.experimental_distribute_dataset(data)

    def _read(self, state: Any) -> dict[str, Any]:
        values = self._all.compute(state)  # one compiled program: all states reduced, all values computed
        return {k: _to_python(values[k]) for k in self._all.metrics}  # Keras' order: loss first

    def _fresh_state(self) -> Any:
        init = self._all.init()
        return self.strategy.experimental_distribute_values_from_function(lambda ctx: init)

    # --- fit -------------------------------------------------------------------------------
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: int | str = "auto", callbacks: Iterable[Callback] | None = None,
            validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True, seed: int = 0,
            sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_batch_size: int | None = None) -> History:
        """Trains for `epochs` epochs; returns the `History` (one entry per epoch and log name).

        `batch_size` is global (all replicas). `x` may be arrays (with `y`, `sample_weight`) or an
        iterable of batches ``(x, y)`` / ``(x, y, sample_weight)``.

        Raises:
          ValueError: `x` and `y` of different lengths, `validation_split` outside [0, 1), ...
        """
        if not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"`epochs` must be a non-negative integer, got epochs={epochs!r}.")
        if not isinstance(validation_split, (int, float)) or not 0.0 <= validation_split < 1.0:
            raise ValueError(f"`validation_split` must be in (0, 1) (or 0 for none), got validation_split={validation_split!r}.")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ValueError(f"`steps_per_epoch` must be a positive integer, got steps_per_epoch={steps_per_epoch!r}.")
        if validation_split:
            if validation_data is not None:
                raise ValueError("pass either `validation_split` or `validation_data`, not both.")
            if not _is_arrays(x):
                raise ValueError("`validation_split` needs array inputs, not an iterable of batches.")
            n = _num_samples(x)
            split = int(n * (1.0 - validation_split))
            if split < 1 or split >= n:
                raise ValueError(f"`validation_split={validation_split}` leaves no training or no validation "
                                 f"sample out of {n}.")
            cut = lambda a, s: None if a is None else jax.tree.map(lambda v: np.asarray(v)[s], a)  # noqa: E731
            validation_data = (cut(x, slice(split, None)), cut(y, slice(split, None)),
                               cut(sample_weight, slice(split, None)))
            x, y, sample_weight = cut(x, slice(0, split)), cut(y, slice(0, split)), cut(sample_weight, slice(0, split))
        train = self._batches(x, y, sample_weight, batch_size, shuffle, seed)
        val = None
        if validation_data is not None:
            if (isinstance(validation_data, tuple) and 2 <= len(validation_data) <= 3
                    and _is_arrays(validation_data[0])):
                vx, vy, vw = (*validation_data, None)[:3]
                val = self._batches(vx, vy, vw, validation_batch_size or batch_size, False, 0, "validation_data")
            else:
                val = self._batches(validation_data, None, None, None, False, 0, "validation_data")
        first, train = self._peek(train)
        self._build(first)

        verbose = 1 if verbose == "auto" else int(verbose)
        history = History()
        cbs = list(callbacks or [])
        if verbose and is_chief():
            bar = ProgbarLogger(verbose)
            steps = len(train) if hasattr(train, "__len__") else None  # type: ignore[arg-type]
            bar.set_params(epochs, min(steps, steps_per_epoch) if steps and steps_per_epoch else steps or steps_per_epoch)
            cbs.insert(0, bar)
        cbs.append(history)
        cblist = CallbackList(cbs, self)
        self.history = history
        self.stop_training = False
        train_step = self._steps["train"]

        backups = [cb for cb in cbs if isinstance(cb, BackupAndRestore)]
        for cb in backups:
            cb.attach(cbs)
        self._global_step = 0
        self._fit_seed = seed
        cblist.on_train_begin()
        # restored after every on_train_begin, which resets callbacks' state
        resume = backups[0].restore() if backups else None
        start_epoch, start_step = (resume.epoch, resume.step) if resume else (initial_epoch, 0)
        logs: dict[str, Any] = {}
        for epoch in range(start_epoch, epochs):
            skip = start_step if epoch == start_epoch else 0
            cblist.on_epoch_begin(epoch)
            state = resume.metric_state if resume is not None and skip else self._fresh_state()
            params, opt_state = self._params, self._opt_state
            step = skip - 1
            for step, batch in enumerate(self._epoch_batches(train, epoch, skip, steps_per_epoch), start=skip):
                cblist.on_train_batch_begin(step)
                params, opt_state, state = self.strategy.run(train_step, args=(params, opt_state, state, batch))
                self._params, self._opt_state = params, opt_state
                self._global_step += 1
                self._progress = (epoch, step + 1, state)
                cblist.on_train_batch_end(step, _LazyLogs(lambda s=state: self._read(s)))
                if backups and backups[0].preempted(self._global_step):
                    backups[0].save_and_exit()
                if self.stop_training:
                    break
            if step < 0:
                raise ValueError(
                    f"`x` yielded no batch in epoch {epoch + 1}: a one-shot iterator is used up after one pass; "
                    "pass a re-iterable (a list, lockstep.data.batches, a tf.data dataset) or `steps_per_epoch`.")
            self._progress = (epoch + 1, 0, state)
            logs = self._read(state)
            if val is not None:
                logs.update({f"val_{k}": v for k, v in self._evaluate_batches(val, cblist).items()})
            cblist.on_epoch_end(epoch, logs)
            self.stop_training = self._agree(self.stop_training)
            if self.stop_training:
                break
        cblist.on_train_end(logs)
        self._adapter.sync_to_model(_host(self._params))
        return history

    def _epoch_batches(self, train: Iterable[Any], epoch: int, skip: int, steps: int | None) -> Iterable[Any]:
        """Epoch `epoch`'s distributed batches from batch `skip` on (at most `steps` in all).

        Array inputs are shuffled from (seed, epoch) alone, so a resumed run sees the same order,
        and every batch is padded to the full batch size, so one compiled step serves them all.
        """
        stop = None if steps is None else max(steps - skip, 0)
        if isinstance(train, Batches):
            padded = math.ceil(train.batch_size / self.strategy.num_replicas_in_sync) * self.strategy.num_replicas_in_sync
            dist = DistributedDataset(self.strategy, train.iterate(epoch, skip), padded_size=padded)
            return itertools.islice(dist, stop)
        return itertools.islice(self._distribute(train), skip, None if steps is None else steps)

    # --- training state for backups ----------------------------------------------------------
    def _state_arrays(self, metric_state: Any) -> dict[str, Any]:
        """Weights, optimizer state and `metric_state` as one flat dict of global arrays."""
        out = {}
        for name, tree in (("params", self._params), ("opt_state", self._opt_state), ("metrics", metric_state)):
            leaves = jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, (Mirrored, PerReplica)))
            for i, v in enumerate(leaves):
                out[f"{name}/{i:05d}"] = jnp.asarray(raw(v))
        return out

    def _load_state_arrays(self, arrays: dict[str, Any]) -> Any:
        """Puts restored weights and optimizer state in place; returns the metric state."""
        def rebuild(name: str, like: Any, wrap: Callable[[Any], Any]) -> Any:
            treedef = jax.tree.structure(like, is_leaf=lambda v: isinstance(v, (Mirrored, PerReplica)))
            return jax.tree.unflatten(treedef, [wrap(arrays[f"{name}/{i:05d}"]) for i in range(treedef.num_leaves)])
        self._params = rebuild("params", self._params, lambda a: a)
        self._opt_state = rebuild("opt_state", self._opt_state, lambda a: a)
        return rebuild("metrics", self._fresh_state(), lambda a: PerReplica(a, self.strategy))

    def _agree(self, flag: bool) -> bool:
        """Every worker takes process 0's decision (each computed it from the same global values)."""
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))

    # --- evaluate / predict --------------------------------------------------------------------
    def _evaluate_batches(self, data: Iterable[Any], cblist: CallbackList | None = None) -> dict[str, Any]:
        first, data = self._peek(data)
        self._build(first)
        state = self._fresh_state()
        step_fn = self._steps["eval"]
        if cblist is not None:
            cblist.on_test_begin()
        for step, batch in enumerate(self._distribute(data)):
            state = self.strategy.run(step_fn, args=(self._params, state, batch))
            if cblist is not None:
                cblist.on_test_batch_end(step, _LazyLogs(lambda s=state: self._read(s)))
        logs = self._read(state)
        if cblist is not None:
            cblist.on_test_end(logs)
        return logs

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, sample_weight: Any = None,
                 verbose: int | str = 0, callbacks: Iterable[Callback] | None = None,
                 return_dict: bool = True) -> dict[str, Any] | list[Any]:
        """Loss and metrics over the whole data, exactly as one device computes them.

        Returns:
          ``{"loss": ..., <metric name>: ...}`` (a list in that order if `return_dict` is False).
        """
        data = self._batches(x, y, sample_weight, batch_size, False, 0)
        cblist = CallbackList(list(callbacks or []), self)
        logs = self._evaluate_batches(data, cblist)
        if verbose and is_chief():
            from ..callbacks._progbar import format_logs

            print(format_logs(logs))
        return logs if return_dict else list(logs.values())

    def predict(self, x: Any, batch_size: int | None = None, verbose: int | str = 0,
                callbacks: Iterable[Callback] | None = None) -> Any:
        """The model's outputs for every sample: exactly `len(x)` rows, in input order (NumPy)."""
        data = self._batches(x, None, None, batch_size, False, 0)
        first, data = self._peek(data)
        self._build(first)
        cblist = CallbackList(list(callbacks or []), self)
        cblist.on_predict_begin()
        outputs = []
        for step, batch in enumerate(self._distribute(data)):
            out = self.strategy.gather(self.strategy.run(self._steps["predict"], args=(self._params, batch)))
            outputs.append(jax.tree.map(np.asarray, out))
            cblist.on_predict_batch_end(step, {"outputs": outputs[-1]})
        cblist.on_predict_end()
        if not outputs:
            raise ValueError("`x` yields no batch to predict on.")
        return jax.tree.map(lambda *parts: np.concatenate(parts, axis=0), *outputs)

    # --- weights -----------------------------------------------------------------------------
    def _require_built(self) -> None:
        if self._params is None:
            raise ValueError("the model has no weights yet: call `fit`, `evaluate` or `predict` first, or build "
                             "the Keras model.")

    def get_weights(self) -> Any:
        """The model's weights as NumPy arrays (Keras: the list `model.get_weights()` gives)."""
        if self._params is None and self._adapter.ready():
            self._place(self._adapter.build(None))
        self._require_built()
        return self._adapter.get_weights(_host(self._params))

    def set_weights(self, weights: Any) -> None:
        """Replaces the weights (same structure as `get_weights`); a Keras model is kept in sync."""
        self.get_weights()
        params = self._adapter.set_weights(_host(self._params), weights)
        self._params = jax.device_put(params, self.strategy._replicated)
        self._adapter.sync_to_model(params)

    @property
    def learning_rate(self) -> float:
        """The optimizer's current learning rate (named optimizers, or optax.inject_hyperparams)."""
        return float(np.asarray(_host(self._lr_holder()["learning_rate"])))

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        hp = self._lr_holder()
        old = _host(hp["learning_rate"])
        hp["learning_rate"] = jax.device_put(np.asarray(value, dtype=np.asarray(old).dtype), self.strategy._replicated)

    def _lr_holder(self) -> dict[str, Any]:
        self._require_built()
        hp = find_hyperparams(self._opt_state)
        if hp is None:
            raise ValueError("the optimizer does not expose its learning rate: use a name such as 'adam', or build "
                             "it with `optax.inject_hyperparams`.")
        return hp

    def save_weights(self, path: str) -> None:
        """Writes the weights to `path` atomically (NumPy `.npz` layout); `load_weights` reads them."""
        save_tree(path, self.get_weights())

    def load_weights(self, path: str) -> None:
        """Reads weights written by `save_weights` (or by `save`)."""
        like = self.get_weights()
        try:
            weights, _ = load_tree(path, like)
        except ValueError:
            tree, _ = load_tree(path, {"weights": like, "opt_state": _host(self._opt_state)})
            weights = tree["weights"]
        self.set_weights(weights)

    def save(self, path: str, epoch: int | None = None) -> None:
        """Writes the training state atomically: a Keras `.keras` file for a Keras model and a
        `.keras` path; else weights, optimizer state and epoch (`.npz` layout)."""
        self._require_built()
        if path.endswith(".keras") and hasattr(self.model, "save"):
            self._adapter.sync_to_model(_host(self._params))
            with atomic_path(path) as tmp:
                self.model.save(tmp)
            return
        extra = {} if epoch is None else {"epoch": epoch}
        save_tree(path, {"weights": self.get_weights(), "opt_state": _host(self._opt_state)}, **extra)
