"""A Keras 3 model as lockstep drives it: `KerasModel`, the adapter a `Trainer` runs a Keras model
through (its `stateless_call`, the Keras variables kept in sync; its layers made exact inside a
replica: `_layers`), the paths of its variables, and what its state will cost each device
(`memory_estimate`).

Randomness: a Keras model's random draws (dropout masks, noise) are what one device draws for
the global batch, each replica's rows of them (`random_draws_as_one_device`). Batch statistics of
Keras `BatchNormalization` layers are taken over the global batch (`lockstep.cross_replica_moments`)
unless the trainer asks for per-replica statistics.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..distribute import get_strategy
from ..engine import get_replica_context, held
from ..training import Optimizer, checked_batch_statistics, keras_metric_names
from ._layers import (activity_penalties_masked, check_activity_regularizers, check_batch_losses, check_supported,
                      draws_following_rows, hook_batch_norm, layer_outputs_named, random_draws_as_one_device)
from ._lending import Lending
from ._optimizer import KerasOptimizer, optimizer_for

Params = dict[str, Any]


class KerasModel:
    """Drives a Keras 3 model through `stateless_call`; the Keras variables are kept in sync.

    Its `BatchNormalization` layers take their batch statistics over the global batch (their
    `_moments` is lockstep's inside a replica, Keras' own elsewhere), unless `batch_statistics`
    is ``"per_replica"``.
    """

    def __init__(self, model: Any, batch_statistics: str = "global"):
        import keras

        checked_batch_statistics(batch_statistics)

        if keras.backend.backend() != "jax":
            raise ValueError(
                f"a Keras model needs the JAX backend, but Keras runs on {keras.backend.backend()!r}: set "
                "the environment variable KERAS_BACKEND=jax before importing keras."
            )
        foreign = keras.distribution.distribution()
        if foreign is not None and not getattr(foreign, "follows_lockstep_scope", False):  # its layouts: ignored
            raise ValueError(
                f"a keras.distribution setting is active ({type(foreign).__name__}): lockstep "
                "places the model itself and would ignore its layouts, running replicated; unset it "
                "(keras.distribution.set_distribution(None)) and use a lockstep strategy: "
                "ls.ShardedStrategy(mesh=..., layout_map=..., batch_dim_name=...) takes Keras' DeviceMesh and "
                "LayoutMap as they are.")
        self.model = model
        check_supported(model)
        hook_batch_norm(model, batch_statistics)
        check_activity_regularizers(model)
        self._trainable: list[int] | None = None  # the trainable variables when built (ids)
        self._draws: dict[Any, tuple[bool, ...] | None] = {}  # draws_following_rows by call signature
        self._lending: Lending | None = None  # the variables' (`lend`), made again when they change

    def ready(self) -> bool:
        return bool(self.model.built)

    def build(self, sample_x: Any) -> Params:
        if not self.model.built:
            self.model(sample_x)  # builds the variables from one real input
        self._trainable = [id(v) for v in self.model.trainable_variables]
        return {"trainable": [held(v.value) for v in self.model.trainable_variables],
                "non_trainable": [held(v.value) for v in self.model.non_trainable_variables]}

    def build_compiled(self, x: Any, y: Any, runs: Optimizer) -> None:
        """Keras' compiled loss and metrics built for a batch like `(x, y)`, as Keras' own `fit`
        builds them (Keras callbacks read them: `EarlyStopping(monitor="val_accuracy")` finds the
        direction of "accuracy" there). A model Keras cannot build so is left as it is, and so is one
        whose unbuilt Keras optimizer the trainer does not run (`runs` is not a `KerasOptimizer`: Keras
        would build it too, slots and all)."""
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(runs, KerasOptimizer) and optimizer is not None and not optimizer.built:
            return
        compiled = getattr(self.model, "_compile_metrics", None), getattr(self.model, "_compile_loss", None)
        if any(c is not None and not c.built for c in compiled):
            try:
                self.model._symbolic_build(data_batch=(x, y))
            except Exception:  # noqa: BLE001 - lockstep's step does not need them; a callback says what it misses
                pass

    def check_batch_losses(self, x: Any, replicas: int) -> None:
        """Refuses, or warns about, `add_loss` terms computed from the batch (`check_batch_losses`)."""
        check_batch_losses(self.model, x, replicas)

    def paths(self, params: Params) -> Any:
        """Each variable's Keras `variable.path`, a tree like `params`."""
        return keras_paths(self.model)

    def variable_names(self, param_paths: list[Any]) -> tuple[list[str], str]:
        """The names backups give the variables at `param_paths` (``dense_1/kernel``:
        `keras_variable_names`), and the model's class."""
        by_id = keras_variable_names(self.model)
        variables = {"trainable": self.model.trainable_variables, "non_trainable": self.model.non_trainable_variables}
        found = [variables[p[0].key][p[1].idx] for p in param_paths]
        return [by_id.get(id(v), v.path) for v in found], type(self.model).__name__

    def optimizer(self, given: Any) -> Optimizer:
        """How the trainer runs `given`: a Keras optimizer object by Keras' own update (`KerasOptimizer`)."""
        return optimizer_for(given, self.model)

    def dtype_policy(self) -> str | None:
        """The model's dtype policy (`model.dtype_policy`, from `keras.config.set_dtype_policy` or
        per model; a loaded mixed model says float32 where its layers keep the mixed one)."""
        policy = getattr(getattr(self.model, "dtype_policy", None), "name", None)
        layers = {getattr(getattr(layer, "dtype_policy", None), "name", None) for layer in self.model.layers}
        mixed = [p for p in ("mixed_float16", "mixed_bfloat16") if p in layers]
        return mixed[0] if policy == "float32" and mixed else policy

    def layers_named(self) -> Any:
        """A context in which the model's layers name their outputs (``remat="layers"``)."""
        return layer_outputs_named(self.model)

    def apply(self, params: Params, x: Any, training: bool) -> tuple[Any, Any, jax.Array | None]:
        rows = int(np.shape(jax.tree.leaves(x)[0])[0])
        flag = {"training": training} if getattr(self.model, "_call_has_training_arg", True) else {}
        with activity_penalties_masked(self.model), random_draws_as_one_device(
                rows, self._following(x, flag), training is not False):
            y, new, losses = self.model.stateless_call(
                params["trainable"], params["non_trainable"], x, return_losses=True, **flag)
        return y, list(new), sum(losses, jnp.zeros(())) if losses else None

    def _following(self, x: Any, flag: dict[str, Any]) -> tuple[bool, ...] | None:
        """`draws_following_rows` for calls on batches like `x` (once a signature), where a replica
        of several draws at random (the model has seed generators)."""
        ctx = get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1 or flag.get("training") is False or not any(
                "seed_generator" in getattr(v, "path", "") for v in self.model.non_trainable_variables):
            return None
        leaves, tree = jax.tree.flatten(x)
        key = (tree, tuple((np.shape(a)[1:], str(a.dtype)) for a in leaves), tuple(flag.items()))
        if key not in self._draws:
            self._draws[key] = draws_following_rows(self.model, x, flag)
        return self._draws[key]

    def _order(self) -> list[tuple[str, int]]:
        """Where each of `model.weights` lives in (trainable, non_trainable)."""
        index = {id(v): ("trainable", i) for i, v in enumerate(self.model.trainable_variables)}
        index.update({id(v): ("non_trainable", i) for i, v in enumerate(self.model.non_trainable_variables)})
        return [index[id(v)] for v in self.model.weights]

    def weights(self, params: Params) -> list[Any]:
        """`params`' arrays in the order of `model.weights` (Keras' `get_weights`), as they are."""
        return [params[kind][i] for kind, i in self._order()]

    def set_weights(self, params: Params, weights: Any) -> Params:
        order = self._order()
        if not isinstance(weights, (list, tuple)) or len(weights) != len(order):
            raise ValueError(f"`weights` must be a list of {len(order)} arrays (the order of `model.weights`), "
                             f"got {type(weights).__name__} of length {len(weights) if hasattr(weights, '__len__') else '?'}.")
        out = {"trainable": list(params["trainable"]), "non_trainable": list(params["non_trainable"])}
        for (kind, i), w in zip(order, weights):
            if np.shape(out[kind][i]) != np.shape(w):
                raise ValueError(f"`weights` holds an array of shape {np.shape(w)} where {np.shape(out[kind][i])} belongs.")
            out[kind][i] = np.asarray(w, dtype=out[kind][i].dtype)
        return out

    def sync_to_model(self, params: Params) -> None:
        for v, value in zip(self.model.trainable_variables, params["trainable"]):
            v.assign(held(value))
        for v, value in zip(self.model.non_trainable_variables, params["non_trainable"]):
            v.assign(held(value))

    def check_unchanged(self) -> None:
        """Raises when a layer's `trainable` changed since `build` (the parameters are split by it)."""
        now = [id(v) for v in self.model.trainable_variables]
        if self._trainable is not None and now != self._trainable:
            raise ValueError(
                f"the model's trainable variables changed after this Trainer was made (a layer's `trainable` was "
                f"set: {len(self._trainable)} trainable variables then, {len(now)} now): make a new Trainer, or, "
                "for model.fit, call `model.compile(...)` again after changing `trainable`, as Keras needs.")

    def check_input(self, x: Any) -> None:
        """Keras' own check of a batch against the model's inputs (a dict's keys by the inputs'
        names, their number and shapes), which `stateless_call` skips: a misspelled key or a list in
        another order is Keras' ValueError, not inputs silently taken in another order."""
        from keras.src.layers.input_spec import assert_input_compatibility  # what Layer.__call__ runs

        spec = self.model.input_spec
        if spec:
            assert_input_compatibility(spec, x, self.model.name)

    def _variables(self) -> list[Any]:
        return [*self.model.trainable_variables, *self.model.non_trainable_variables]

    def metric_objects(self) -> dict[str, Any]:
        """The model's Keras metric objects by the names its logs give them (its loss trackers, a
        compiled metric made from a name, as `output_accuracy` where the model has several outputs),
        which the trainer gives the states of its metrics of those names when a loop ends, as Keras'
        loops leave them (``model.metrics[1].result()`` after `fit` is the epoch's value)."""
        found: dict[str, Any] = {}

        def walk(metric: Any) -> None:
            lists = getattr(metric, "_flat_metrics", None)
            if isinstance(lists, list):  # Keras' CompileMetrics: its `result()`'s names
                entries = [(f"{group.output_name}_" if group.output_name else "", m, weighted)
                           for groups, weighted in ((lists, False), (metric._flat_weighted_metrics, True))
                           for group in groups if group for m in group.metrics]
                names = keras_metric_names((prefix, m.name, weighted) for prefix, m, weighted in entries)
                found.update((name, m) for name, (_, m, _) in zip(names, entries) if name not in found)
            elif isinstance(getattr(metric, "metrics", None), list):  # Keras' CompileLoss: the outputs' losses
                for m in metric.metrics:
                    walk(m)
            elif getattr(metric, "variables", None):
                found.setdefault(metric.name, metric)
        for metric in self.model.metrics:
            walk(metric)
        return found

    def lend(self, params: Params, copies: bool = True) -> list[Any]:
        """The Keras variables made to hold `params` as they lie on the devices (no copy), for a
        user's code that reads or assigns them (a variable given None keeps what it holds; for
        `copies`, see `Lending`); returns what each holds, for `taken`."""
        return self._lender().lend([*params["trainable"], *params["non_trainable"]], copies)

    def lent_variables(self, params: Params) -> list[Any]:
        """The variables that ``lend(params, copies=False)`` lends their arrays (`params` may be
        shapes with shardings: those it would lend arrays so laid out)."""
        return self._lender().takers([*params["trainable"], *params["non_trainable"]])

    def _lender(self) -> Lending:
        variables = self._variables()
        lending = self._lending
        if lending is None or len(lending.variables) != len(variables) or any(
                a is not b for a, b in zip(lending.variables, variables)):
            lending = self._lending = Lending(variables)
        return lending

    def taken(self, lent: list[Any]) -> Params | None:
        """The variables' values when any was assigned since `lend` gave `lent` (else None)."""
        variables = self._variables()
        if len(variables) == len(lent) and all(v.value is x for v, x in zip(variables, lent)):
            return None
        values = [v.value for v in variables]
        n = len(self.model.trainable_variables)
        return {"trainable": values[:n], "non_trainable": values[n:]}


def _snake(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def keras_variable_names(model: Any) -> dict[int, str]:
    """``id(variable) -> name`` for every variable of a Keras model, by position among layers
    of the same class (nested models walked), then the variable's path inside its layer."""
    names: dict[int, str] = {}

    def walk(container: Any, prefix: str) -> None:
        used: dict[str, int] = {}
        for layer in getattr(container, "layers", []):
            base = _snake(type(layer).__name__)
            n = used.get(base, 0)
            used[base] = n + 1
            here = f"{prefix}{base}" + (f"_{n}" if n else "")
            if getattr(layer, "layers", None):
                walk(layer, here + "/")
            for v in layer.weights:
                parts = v.path.split("/")
                inner = parts[len(parts) - parts[::-1].index(layer.name):] if layer.name in parts[:-1] else [v.name]
                names.setdefault(id(v), f"{here}/{'/'.join(inner)}")

    walk(model, "")
    for v in model.weights:  # the model's own variables
        names.setdefault(id(v), v.name)
    return names


def keras_paths(model: Any) -> dict[str, list[str]]:
    """A Keras model's variables' paths, as a `Trainer` holds their values."""
    return {"trainable": [v.path for v in model.trainable_variables],
            "non_trainable": [v.path for v in model.non_trainable_variables]}


def memory_estimate(model: Any, optimizer: Any = "adam", strategy: Any = None) -> dict[str, int]:
    """Bytes of parameters, gradients (in a step) and optimizer state each device of `strategy`
    (default: the active scope's) will hold for `model` (a built Keras model) trained with
    `optimizer` (a name, a Keras optimizer or an optax transformation), worked out before
    anything is placed: DeepSpeed's table. Padded variables (splits that do not divide them)
    count their padded shards; not counted: the model's own Keras variables, which hold such a
    variable without the split that does not divide it.

    >>> import lockstep as ls, keras
    >>> strategy = ls.ShardedStrategy(mesh=ls.DeviceMesh((8, 1), ("batch", "model")), zero_stage=3,
    ...                               min_shard_size=1)
    >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64)])
    >>> ls.memory_estimate(model, "adam", strategy)["parameters"]   # (16 * 64 + 64) * 4 bytes over 8 devices
    544
    """
    engine = (strategy or get_strategy()).extended
    shapes = {"trainable": [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in model.trainable_variables],
              "non_trainable": [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in model.non_trainable_variables]}
    return optimizer_for(optimizer, model).layout(engine, shapes, keras_paths(model)).estimate(shapes)
