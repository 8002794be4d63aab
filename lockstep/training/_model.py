"""Model adapters: the one interface a `Trainer` drives a model through, and a plain JAX
`FunctionalModel`'s (a Keras 3 model's is `lockstep.keras`'s, which its `Trainer` adapts).

An adapter gives the compiled steps parameters as a pytree ``{"trainable": ..., "non_trainable":
...}`` and a pure ``apply(params, x, training)`` that returns ``(y_pred, new_non_trainable,
penalty)``: the penalty is the model's own losses (regularisers, `add_loss`) on this replica, or
None when it has none. A `FunctionalModel`'s key is ``fold_in(fold_in(key(seed), step),
replica)`` (its draws differ per replica, reproducibly; on one replica, what one device draws).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..engine import get_replica_context
from ._optimizers import Optimizer, get_optimizer
from ._state_names import by_tree_paths

BATCH_STATISTICS = ("global", "per_replica")

Params = dict[str, Any]


class FunctionalModel:
    """A plain JAX model given as two functions.

    Args:
      init: ``init(rng, sample_x) -> params`` (any pytree of arrays).
      apply: ``apply(params, x, training=False) -> y`` (or ``apply(params, x)``); if it declares a parameter ``rng``, it
        is called with a fresh PRNG key each call: ``fold_in(fold_in(key(seed), step), replica)``
        (the trainer's `seed`; a counter of calls in training; the replica's index), so dropout
        masks differ between replicas and steps and repeat for the same seed and replicas.

    >>> import jax, jax.numpy as jnp, numpy as np, lockstep as ls
    >>> model = ls.FunctionalModel(
    ...     init=lambda rng, x: {"w": jax.random.normal(rng, (x.shape[-1], 2))},
    ...     apply=lambda p, x, training=False: x @ p["w"])
    >>> params = model.init(jax.random.key(0), np.ones((1, 3), np.float32))
    >>> model.apply(params, np.ones((4, 3), np.float32)).shape
    (4, 2)
    """

    def __init__(self, init: Callable[..., Any], apply: Callable[..., Any]):
        if not callable(init):
            raise TypeError(f"`init` must be callable, got {type(init).__name__}.")
        if not callable(apply):
            raise TypeError(f"`apply` must be callable, got {type(apply).__name__}.")
        self.init = init
        self.apply = apply


class _FunctionalAdapter:
    def __init__(self, model: FunctionalModel, seed: int):
        self.model = model
        self._seed = seed
        self._params: Params | None = None
        try:
            params = inspect.signature(model.apply).parameters
        except (TypeError, ValueError):  # a callable without a readable signature
            params = {}
        self._wants_rng = "rng" in params
        # `apply(params, x)` without `training` (a TF user's `model(x)`) is called without it
        self._takes_training = not params or "training" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values())

    def ready(self) -> bool:
        """Whether parameters exist without seeing data (never, for a functional model)."""
        return self._params is not None

    def build(self, sample_x: Any) -> Params:
        if self._params is None:
            params = self.model.init(jax.random.key(self._seed), sample_x)
            state = {"rng_step": np.zeros((), np.uint32)} if self._wants_rng else ()
            self._params = {"trainable": jax.tree.map(np.asarray, params), "non_trainable": state}
        return self._params

    def apply(self, params: Params, x: Any, training: bool) -> tuple[Any, Any, jax.Array | None]:
        state = params["non_trainable"]
        flag = {"training": training} if self._takes_training else {}
        if not self._wants_rng:
            return self.model.apply(params["trainable"], x, **flag), state, None
        key = jax.random.fold_in(jax.random.key(self._seed), state["rng_step"])
        ctx = get_replica_context()
        if ctx is not None:
            key = jax.random.fold_in(key, ctx.replica_id_in_sync_group)
        y = self.model.apply(params["trainable"], x, rng=key, **flag)
        return y, {"rng_step": state["rng_step"] + jnp.uint32(1)} if training else state, None  # (inference: as given)

    def weights(self, params: Params) -> Any:
        """`params`' arrays as `get_weights` gives them (the trainable tree), as they are."""
        return params["trainable"]

    def variable_names(self, param_paths: list[Any]) -> tuple[list[str], str]:
        """The names backups give the parameters at `param_paths`: their paths (`by_tree_paths`)."""
        return by_tree_paths(param_paths)

    def optimizer(self, given: Any) -> Optimizer:
        """How the trainer runs `given`, a name or an optax transformation (`get_optimizer`)."""
        return Optimizer(get_optimizer(given))

    def dtype_policy(self) -> str | None:
        """A function has no dtype policy of its own: the trainer's `dtype_policy` is its."""
        return None

    def layers_named(self) -> Any:
        """A function has no layers: ``remat="layers"`` keeps nothing but its inputs (as "full")."""
        return contextlib.nullcontext()

    def paths(self, params: Params) -> Any:
        """Each parameter's path (its keys joined by ``/``: ``"dense/w"``), a tree like `params`."""
        def path(p: Any) -> str:
            return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in p[1:])
        return jax.tree_util.tree_map_with_path(lambda p, _: path(p), params)

    def set_weights(self, params: Params, weights: Any) -> Params:
        want = jax.tree.structure(params["trainable"])
        got = jax.tree.structure(weights)
        if want != got:
            raise ValueError(f"`weights` must have the structure of the model's parameters {want}, got {got}.")
        for a, b in zip(jax.tree.leaves(params["trainable"]), jax.tree.leaves(weights)):
            if np.shape(a) != np.shape(b):
                raise ValueError(f"`weights` holds an array of shape {np.shape(b)} where {np.shape(a)} belongs.")
        return {"trainable": jax.tree.map(np.asarray, weights), "non_trainable": params["non_trainable"]}

    def sync_to_model(self, params: Params) -> None:
        self._params = params

    def check_unchanged(self) -> None:
        """A functional model's parameters cannot change kind (see `lockstep.keras.KerasModel.check_unchanged`)."""

    def check_input(self, x: Any) -> None:
        """Nothing to check beyond what `apply` takes (see `lockstep.keras.KerasModel.check_input`)."""

    def metric_objects(self) -> dict[str, Any]:
        """No metric objects of its own (see `lockstep.keras.KerasModel.metric_objects`)."""
        return {}

    def lend(self, params: Params, copies: bool = True) -> None:
        """No Keras variables to lend (see `lockstep.keras.KerasModel.lend`)."""

    def lent_variables(self, params: Params) -> list[Any]:
        """None: no Keras variables (see `lockstep.keras.KerasModel.lent_variables`)."""
        return []

    def taken(self, lent: Any) -> Params | None:
        return None


def checked_batch_statistics(batch_statistics: str) -> str:
    if batch_statistics not in BATCH_STATISTICS:
        raise ValueError(f"`batch_statistics` must be one of {BATCH_STATISTICS}, got {batch_statistics!r}.")
    return batch_statistics


def adapt(model: Any, seed: int = 0, batch_statistics: str = "global") -> Any:
    """The adapter for `model`, a `FunctionalModel` (`lockstep.Trainer` adapts Keras 3 models too)."""
    checked_batch_statistics(batch_statistics)
    if isinstance(model, FunctionalModel):
        return _FunctionalAdapter(model, seed)
    raise TypeError(f"`model` must be a lockstep.FunctionalModel here, got {type(model).__name__}: lockstep.Trainer "
                    "(lockstep.keras.Trainer) takes Keras 3 models too.")


def output_shape(adapter: Any, params: Params, x: Any, apply: Callable[..., Any] | None = None) -> Any:
    """The shape of the model's output on `x` (a tree of shapes for several outputs; traced, not
    run; `x` already passed the trainer's `InputCheck`). A built Keras model states it (no trace
    of the model needed); else `apply` (default the adapter's) runs on `params`."""
    try:
        declared = getattr(getattr(adapter, "model", None), "output_shape", None)
    except (AttributeError, ValueError, RuntimeError):
        declared = None
    if isinstance(declared, tuple) and declared and all(isinstance(d, int) for d in declared[1:]):
        return (jax.tree.leaves(x)[0].shape[0], *declared[1:])
    apply = apply or adapter.apply
    out = jax.eval_shape(lambda p, x: apply(p, x, False)[0], params, x)
    return jax.tree.map(lambda a: tuple(a.shape), out)
