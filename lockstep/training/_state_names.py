"""Names of a training state's arrays, stable across processes, and the identity of its model and
optimizer: what a backup records so that a restore matches arrays by name, not by position.

A Keras model's variable is named by where it sits in the model, the way Keras' own weight files
address it (``dense_1/kernel``: the second `Dense` layer, counted by class; never the
auto-generated ``sequential_4/dense_9`` of one process). A `FunctionalModel`'s parameter is named
by its path in the parameter tree (``['w1']``). An optimizer state array is named by its path in
the optax state with the parameter it belongs to (``inner_state[0].mu:dense_1/kernel``), or for
a Keras optimizer by its parameter and slot (``dense_1/kernel:momentum``).

>>> import jax.numpy as jnp, optax
>>> params = {"trainable": {"w": jnp.zeros(2)}, "non_trainable": {}}
>>> names = state_names(None, optax.adam(0.1), params, optax.adam(0.1).init(params["trainable"]))
>>> names.params, names.opt_state[1], names.optimizer
(("['trainable']['w']",), "[0].mu:['trainable']['w']", 'ScaleByAdamState, EmptyState')
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from .._keras_kind import is_keras as is_keras_object
from ._optimizers import keras_state_owners, keras_state_variables


@dataclasses.dataclass(frozen=True)
class StateNames:
    """One name per array of `params` and of `opt_state` (flattening order), and what the model
    and the optimizer are (``"Sequential"``; ``"keras Adam"`` or the optax state's node types)."""

    params: tuple[str, ...]
    opt_state: tuple[str, ...]
    model: str
    optimizer: str

    def to_json(self) -> dict[str, Any]:
        return {"params": list(self.params), "opt_state": list(self.opt_state), "model": self.model,
                "optimizer": self.optimizer}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StateNames":
        return cls(tuple(data["params"]), tuple(data["opt_state"]), str(data["model"]), str(data["optimizer"]))


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


def _unique(names: list[str]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        out.append(n if n not in seen else f"{n}#{seen[n]}")
        seen[n] = seen.get(n, 0) + 1
    return tuple(out)


def _node_types(tree: Any) -> str:
    """The optax state's named nodes, in order (``ScaleByAdamState, EmptyState``)."""
    out: list[str] = []

    def walk(t: Any) -> None:
        if isinstance(t, tuple) and hasattr(t, "_fields"):
            out.append(type(t).__name__)
        if isinstance(t, (list, tuple)):
            for c in t:
                walk(c)
        elif isinstance(t, dict):
            for c in t.values():
                walk(c)
    walk(tree)
    return ", ".join(out) or type(tree).__name__


def _keras_optimizer_names(optimizer: Any, model: Any, params_names: dict[int, str], opt_state: Any) -> list[str]:
    """A Keras optimizer's state (`KerasOptimizerState`: its variables, the learning rate apart)
    named by parameter and slot (``dense/kernel:momentum``), else by the variable's own name."""
    trainable = model.trainable_variables
    names = []
    for v, owner in zip(keras_state_variables(optimizer), keras_state_owners(optimizer, trainable)):
        if owner is None:
            names.append(v.name)
        else:
            slot = v.path.split("/", 1)[-1][len(trainable[owner].path.replace("/", "_")) + 1:]
            names.append(f"{params_names.get(id(trainable[owner]), trainable[owner].path)}:{slot}")
    hyper = list(getattr(opt_state, "hyperparams", None) or {})
    if not hasattr(opt_state, "hyperparams") or len(names) + len(hyper) != len(jax.tree.leaves(opt_state)):
        # not the layout `from_keras` makes (loss scaling wraps it): tree paths
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
    return names + hyper


def state_names(model: Any, optimizer: Any, params: Any, opt_state: Any) -> StateNames:
    """The `StateNames` of a trainer's `params` and `opt_state`: `model` is the Keras model or
    `FunctionalModel` (None: named by tree paths), `optimizer` what the trainer was given."""
    param_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    is_keras = model is not None and hasattr(model, "trainable_variables") and hasattr(model, "layers")
    by_id: dict[int, str] = {}
    if is_keras:  # params are {"trainable": [...], "non_trainable": [...]} in the model's orders
        by_id = keras_variable_names(model)
        variables = {"trainable": model.trainable_variables, "non_trainable": model.non_trainable_variables}

        def name_of(path: Any) -> str:
            v = variables[path[0].key][path[1].idx]
            return by_id.get(id(v), v.path)
    else:
        name_of = jax.tree_util.keystr
    names = [name_of(p) for p in param_paths]
    if is_keras and is_keras_object(optimizer):
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        opt_names = _keras_optimizer_names(inner, model, by_id, opt_state)
        identity = f"keras {type(inner).__name__}"
    else:
        # the optimizer state of a parameter sits where the trainable tree's path of it ends the state's path
        owners = {jax.tree_util.keystr(p[1:]): n for p, n in zip(param_paths, names)
                  if getattr(p[0], "key", None) == "trainable"}
        opt_names = []
        for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
            key = jax.tree_util.keystr(path)
            owner = max((k for k in owners if k and key.endswith(k)), key=len, default=None)
            opt_names.append(key if owner is None else f"{key[:-len(owner)].lstrip('.')}:{owners[owner]}")
        identity = _node_types(opt_state)
    model_name = "FunctionalModel" if not is_keras else type(model).__name__
    return StateNames(_unique(names), _unique(opt_names), model_name, identity)
