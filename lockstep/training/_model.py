"""Model adapters: a Keras 3 model (JAX backend, stateless API) or a plain JAX `FunctionalModel`.

Both expose one interface to the compiled steps: parameters as a pytree
``{"trainable": ..., "non_trainable": ...}`` and a pure ``apply(params, x, training)`` that
returns ``(y_pred, new_non_trainable, extra_loss)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


class FunctionalModel:
    """A plain JAX model given as two functions.

    Args:
      init: ``init(rng, sample_x) -> params`` (any pytree of arrays).
      apply: ``apply(params, x, training=False) -> y``.

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

    def ready(self) -> bool:
        """Whether parameters exist without seeing data (never, for a functional model)."""
        return self._params is not None

    def build(self, sample_x: Any) -> Params:
        if self._params is None:
            params = self.model.init(jax.random.key(self._seed), sample_x)
            self._params = {"trainable": jax.tree.map(np.asarray, params), "non_trainable": ()}
        return self._params

    def apply(self, params: Params, x: Any, training: bool) -> tuple[Any, Any, jax.Array]:
        return self.model.apply(params["trainable"], x, training=training), params["non_trainable"], jnp.zeros(())

    def get_weights(self, params: Params) -> Any:
        return jax.tree.map(np.asarray, params["trainable"])

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


class _KerasAdapter:
    """Drives a Keras 3 model through `stateless_call`; the Keras variables are kept in sync."""

    def __init__(self, model: Any):
        import keras

        if keras.backend.backend() != "jax":
            raise ValueError(
                f"a Keras model needs the JAX backend, but Keras runs on {keras.backend.backend()!r}: set "
                "the environment variable KERAS_BACKEND=jax before importing keras."
            )
        self.model = model

    def ready(self) -> bool:
        return bool(self.model.built)

    def build(self, sample_x: Any) -> Params:
        if not self.model.built:
            self.model(sample_x)  # builds the variables from one real input
        return {"trainable": [np.asarray(v.value) for v in self.model.trainable_variables],
                "non_trainable": [np.asarray(v.value) for v in self.model.non_trainable_variables]}

    def apply(self, params: Params, x: Any, training: bool) -> tuple[Any, Any, jax.Array]:
        y, non_trainable, losses = self.model.stateless_call(
            params["trainable"], params["non_trainable"], x, training=training, return_losses=True)
        extra = sum(losses, jnp.zeros(())) if losses else jnp.zeros(())
        return y, list(non_trainable), extra

    def _order(self) -> list[tuple[str, int]]:
        """Where each of `model.weights` lives in (trainable, non_trainable)."""
        index = {id(v): ("trainable", i) for i, v in enumerate(self.model.trainable_variables)}
        index.update({id(v): ("non_trainable", i) for i, v in enumerate(self.model.non_trainable_variables)})
        return [index[id(v)] for v in self.model.weights]

    def get_weights(self, params: Params) -> list[np.ndarray]:
        return [np.asarray(params[kind][i]) for kind, i in self._order()]

    def set_weights(self, params: Params, weights: Any) -> Params:
        order = self._order()
        if not isinstance(weights, (list, tuple)) or len(weights) != len(order):
            raise ValueError(f"`weights` must be a list of {len(order)} arrays (the order of `model.weights`), "
                             f"got {type(weights).__name__} of length {len(weights) if hasattr(weights, '__len__') else '?'}.")
        out = {"trainable": list(params["trainable"]), "non_trainable": list(params["non_trainable"])}
        for (kind, i), w in zip(order, weights):
            if np.shape(out[kind][i]) != np.shape(w):
                raise ValueError(f"`weights` holds an array of shape {np.shape(w)} where {np.shape(out[kind][i])} belongs.")
            out[kind][i] = np.asarray(w, dtype=np.asarray(out[kind][i]).dtype)
        return out

    def sync_to_model(self, params: Params) -> None:
        for v, value in zip(self.model.trainable_variables, params["trainable"]):
            v.assign(np.asarray(value))
        for v, value in zip(self.model.non_trainable_variables, params["non_trainable"]):
            v.assign(np.asarray(value))


def adapt(model: Any, seed: int = 0) -> _FunctionalAdapter | _KerasAdapter:
    """The adapter for `model`: a `FunctionalModel` or a Keras 3 model."""
    if isinstance(model, FunctionalModel):
        return _FunctionalAdapter(model, seed)
    try:
        import keras
    except ImportError:  # pragma: no cover - keras is a dependency
        keras = None
    if keras is not None and isinstance(model, keras.Model):
        return _KerasAdapter(model)
    raise TypeError(f"`model` must be a Keras 3 model or a lockstep.FunctionalModel, got {type(model).__name__}.")
