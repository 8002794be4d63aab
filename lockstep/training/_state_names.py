"""Names of a training state's arrays, stable across processes, and the identity of its model and
optimizer: what a backup records so that a restore matches arrays by name, not by position.

The model adapter names the parameters, the optimizer its state. A Keras model's variable
(`lockstep.keras`) is named by where it sits in the model, the way Keras' own weight files
address it (``dense_1/kernel``: the second `Dense` layer, counted by class; never the
auto-generated ``sequential_4/dense_9`` of one process). A `FunctionalModel`'s parameter is named
by its path in the parameter tree (``['w1']``). An optimizer state array is named by its path in
the optax state with the parameter it belongs to (``inner_state[0].mu:dense_1/kernel``), or for
a Keras optimizer by its parameter and slot (``dense_1/kernel:momentum``).

>>> import jax.numpy as jnp, optax
>>> from lockstep.training import Optimizer
>>> params = {"trainable": {"w": jnp.zeros(2)}, "non_trainable": {}}
>>> names = state_names(by_tree_paths, Optimizer(optax.adam(0.1)), params, optax.adam(0.1).init(params["trainable"]))
>>> names.params, names.opt_state[1], names.optimizer
(("['trainable']['w']",), "[0].mu:['trainable']['w']", 'ScaleByAdamState, EmptyState')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


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


def _unique(names: list[str]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        out.append(n if n not in seen else f"{n}#{seen[n]}")
        seen[n] = seen.get(n, 0) + 1
    return tuple(out)


def by_tree_paths(param_paths: list[Any]) -> tuple[list[str], str]:
    """A `FunctionalModel`'s parameters named by their paths in the parameter tree (``['w1']``)."""
    return [jax.tree_util.keystr(p) for p in param_paths], "FunctionalModel"


def state_names(variable_names: Callable[[list[Any]], tuple[list[str], str]], optimizer: Any, params: Any,
                opt_state: Any) -> StateNames:
    """The `StateNames` of a trainer's `params` and `opt_state`: `variable_names` names the
    parameters, given their tree paths, and says what the model is (a model adapter's:
    `by_tree_paths`, or a Keras model's); `optimizer` (a `lockstep.training.Optimizer`) names its
    state, given each trainable parameter's path in the trainable tree and its name."""
    param_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    names, model_name = variable_names(param_paths)
    trainable = [(jax.tree_util.keystr(p[1:]), n) for p, n in zip(param_paths, names)
                 if getattr(p[0], "key", None) == "trainable"]
    opt_names, identity = optimizer.state_names(trainable, opt_state)
    return StateNames(_unique(names), _unique(opt_names), model_name, identity)
