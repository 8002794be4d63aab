"""Optimizers as a `Trainer` runs them (`Optimizer`: an optax transformation, how its state is laid
out and named), names resolved to optax, and the learning rate exposed for callbacks."""

from __future__ import annotations

import copy
from typing import Any

import jax
import numpy as np
import optax

from .._keras_kind import is_keras
from ..sharding import Replicated, Slots, state_layout
from ._precision import with_loss_scaling

def keras_adam(learning_rate: Any, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-7,
               weight_decay: float | None = None) -> optax.GradientTransformation:
    """Keras' `Adam` (and with `weight_decay`, its `AdamW`) as an optax transformation, step for
    step: Keras adds `eps` to ``sqrt(v)`` before the bias correction, which it folds into the
    learning rate (``lr * sqrt(1 - b2^t) / (1 - b1^t)``), where `optax.adam` adds it after: with
    small gradients the weights differ by ~1e-3 after a few dozen steps. Its state is optax's `ScaleByAdamState`.

    >>> import jax.numpy as jnp
    >>> opt = keras_adam(0.1)
    >>> updates, _ = opt.update({"w": jnp.array([1e-6])}, opt.init({"w": jnp.zeros(1)}))
    >>> float(updates["w"][0])   # -0.1 * 1e-6 * 0.1 * sqrt(0.001) / 0.1 / (1e-6 * sqrt(0.001) + 1e-7)
    -0.024025...
    """
    import jax
    import jax.numpy as jnp

    def init(params: Any) -> optax.ScaleByAdamState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.zeros_like, params))

    def update(grads: Any, state: optax.ScaleByAdamState, params: Any = None) -> Any:
        count = state.count + 1
        t = count.astype(jnp.float32)
        mu = jax.tree.map(lambda m, g: m + (g - m) * (1 - b1), state.mu, grads)
        nu = jax.tree.map(lambda v, g: v + (g * g - v) * (1 - b2), state.nu, grads)
        alpha = learning_rate * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        updates = jax.tree.map(lambda m, v: -(m * alpha.astype(m.dtype)) / (jnp.sqrt(v) + eps), mu, nu)
        if weight_decay is not None:  # Keras decays the variable by lr * wd before the step
            updates = jax.tree.map(lambda u, p: u - p * (weight_decay * learning_rate), updates, params)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
    return optax.GradientTransformation(init, update)


# name -> (optax factory, Keras' default learning rate, Keras-like defaults)
_OPTIMIZERS: dict[str, tuple[Any, float, dict[str, Any]]] = {
    "adam": (keras_adam, 1e-3, {}),
    "adamw": (keras_adam, 1e-3, {"weight_decay": 0.004}),
    "sgd": (optax.sgd, 1e-2, {}),
    "rmsprop": (optax.rmsprop, 1e-3, {"decay": 0.9, "eps": 1e-7}),
}


def get_optimizer(optimizer: Any) -> optax.GradientTransformation:
    """An optax transformation from a name (``"adam"``, ``"adamw"``, ``"sgd"``, ``"rmsprop"``) or as
    given (a Keras optimizer object is `lockstep.keras`'s: it runs with the Keras model it was
    built for).

    Named optimizers are built with `optax.inject_hyperparams`, so `Trainer.learning_rate` can be
    read and changed (LearningRateScheduler, ReduceLROnPlateau) without recompiling.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
      TypeError: neither a name nor an optax transformation.
    """
    if isinstance(optimizer, str):
        entry = _OPTIMIZERS.get(optimizer.lower())
        if entry is None:
            raise ValueError(f"`optimizer` must be an optax transformation or one of {sorted(_OPTIMIZERS)}, "
                             f"got optimizer={optimizer!r}.")
        factory, lr, kwargs = entry
        return optax.inject_hyperparams(factory)(learning_rate=lr, **kwargs)
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if is_keras(optimizer) and hasattr(optimizer, "stateless_apply"):
        raise TypeError("a Keras optimizer object needs a Keras model with its variables (a subclassed model "
                        "makes them when first called: call it on a batch, or `model.build(input_shape)`, "
                        "first); for a FunctionalModel pass an optax transformation or a name.")
    raise TypeError(f"`optimizer` must be a name, a Keras optimizer or an optax.GradientTransformation, got "
                    f"{type(optimizer).__name__}.")


class Optimizer:
    """An optimizer as a `Trainer` runs it: an optax `transformation`, and what else holds or names
    its state. A model adapter's ``optimizer(given)`` makes one: this one for a name or an optax
    transformation (`get_optimizer`), whose state only the trainer holds, named by its tree paths;
    `lockstep.keras`'s for a Keras optimizer object, which lays its slots out as their variables,
    names them by variable and slot, and is given the trained state back.

    >>> import jax.numpy as jnp
    >>> opt = Optimizer(optax.adam(0.1))
    >>> names, identity = opt.state_names([("['w']", "w")], opt.transformation.init({"w": jnp.zeros(2)}))
    >>> names[1], identity
    ('[0].mu:w', 'ScaleByAdamState, EmptyState')
    """

    #: how its state follows the parameters (`lockstep.sharding.Slots`); None: found by tree paths
    slots: Slots | None = None

    def __init__(self, transformation: optax.GradientTransformation):
        self.transformation = transformation

    @property
    def variables(self) -> list[Any]:
        """The model object's own variables that hold this optimizer's state (none here)."""
        return []

    def loss_scale(self) -> tuple[float, int, int]:
        """(scale, growth steps, finite steps since the scale last changed) dynamic loss scaling
        starts from: Keras' `LossScaleOptimizer` defaults (2**15, 2000, 0)."""
        return 2.0**15, 2000, 0

    def scaled(self) -> "Optimizer":
        """This optimizer under dynamic loss scaling (``mixed_float16``), from `loss_scale`."""
        out = copy.copy(self)
        out.transformation = with_loss_scaling(self.transformation, *self.loss_scale())
        return out

    def layout(self, engine: Any, params: Any, paths: Any) -> Replicated:
        """Where a trainer on `engine` (a strategy's `extended`) keeps `params` (whose paths are
        `paths`) and this optimizer's state: `lockstep.sharding`'s layout."""
        return state_layout(engine, engine.sharding, self.transformation, params, paths, self.slots)

    def write_back(self, opt_state: Any) -> None:
        """Gives the trained state (host arrays) to what holds it besides the trainer: nothing here."""

    def lend(self, opt_state: Any, whole: bool = False) -> None:
        """Makes what holds the state besides the trainer (a Keras optimizer's variables) hold
        `opt_state`'s arrays as they lie, no copy (`whole`: and what is read off the devices for
        them, and where they lie otherwise, copies); nothing here."""

    def lent_variables(self, opt_state: Any) -> list[Any]:
        """The variables that `lend` (not `whole`) lends arrays of `opt_state`; none here."""
        return []

    def iterations(self, opt_state: Any) -> Any:
        """The optimizer's own count of the updates it applied, in `opt_state` (a device array, as
        Keras' `optimizer.iterations` holds it), or None where it keeps none (here)."""
        return None

    def state_names(self, trainable: list[tuple[str, str]], opt_state: Any) -> tuple[list[str], str]:
        """A name for each array of `opt_state` (flattening order), and what the optimizer is (the
        optax state's node types), given each trainable parameter's path in the trainable tree and
        its name (`trainable`): an array is named by its path in the state with the parameter it
        belongs to, whose path ends the array's (``[0].mu:dense_1/kernel``)."""
        owners = dict(trainable)
        names = []
        for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
            key = jax.tree_util.keystr(path)
            owner = max((k for k in owners if k and key.endswith(k)), key=len, default=None)
            names.append(key if owner is None else f"{key[:-len(owner)].lstrip('.')}:{owners[owner]}")
        return names, _node_types(opt_state)


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


def find_hyperparams(opt_state: Any) -> dict[str, Any] | None:
    """The `hyperparams` dict of an `inject_hyperparams` state inside `opt_state`, if any."""
    stack = [opt_state]
    while stack:
        node = stack.pop()
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, dict) and "learning_rate" in hp:
            return hp
        if isinstance(node, (tuple, list)):
            stack.extend(node)
    return None


def _hyperparams(opt_state: Any) -> dict[str, Any]:
    hp = find_hyperparams(opt_state)
    if hp is None:
        raise ValueError("the optimizer does not expose its learning rate: use a name such as 'adam', or build "
                         "it with `optax.inject_hyperparams`.")
    return hp


def learning_rate_of(opt_state: Any) -> Any:
    """The learning rate held in `opt_state` (an `inject_hyperparams` state)."""
    return _hyperparams(opt_state)["learning_rate"]


def set_learning_rate(opt_state: Any, value: float, place: Any) -> None:
    """Sets the learning rate inside `opt_state` in place (same dtype, placed by `place`), so the
    compiled step is reused."""
    hp = _hyperparams(opt_state)
    hp["learning_rate"] = place(np.asarray(value, dtype=np.asarray(hp["learning_rate"]).dtype))
