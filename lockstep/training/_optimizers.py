"""Optimizer names resolved to optax, with the learning rate exposed for callbacks."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from .._keras_kind import is_keras
from ..engine import held
from ..sharding import Slots

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


def get_optimizer(optimizer: Any, trainable_variables: Any = None) -> optax.GradientTransformation:
    """An optax transformation from a name (``"adam"``, ``"adamw"``, ``"sgd"``, ``"rmsprop"``), a Keras
    optimizer object (run through Keras' own update, see `from_keras`; `trainable_variables` are
    the Keras model's), or as given.

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
    if is_keras_optimizer(optimizer):
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer: lockstep scales
        if not trainable_variables:
            raise TypeError("a Keras optimizer object needs a Keras model with its variables (a subclassed model "
                            "makes them when first called: call it on a batch, or `model.build(input_shape)`, "
                            "first); for a FunctionalModel pass an optax transformation or a name.")
        return from_keras(optimizer, trainable_variables)
    raise TypeError(f"`optimizer` must be a name, a Keras optimizer or an optax.GradientTransformation, got "
                    f"{type(optimizer).__name__}.")


def is_loss_scaled(optimizer: Any) -> bool:
    """Whether `optimizer` is a Keras `LossScaleOptimizer` (`compile` wraps one under
    ``mixed_float16`` unless given ``auto_scale_loss=False``)."""
    return hasattr(optimizer, "inner_optimizer") and hasattr(optimizer, "dynamic_growth_steps")


def loss_scale_settings(optimizer: Any) -> tuple[float, int, int]:
    """(scale, growth steps, finite steps since the scale last changed) of a Keras
    `LossScaleOptimizer` (Keras' `compile` wraps the optimizer in one under ``mixed_float16``):
    where it stands after earlier training (a loaded model's), else its initial scale; without
    one, Keras' defaults (2**15, 2000, 0)."""
    if is_loss_scaled(optimizer):
        if optimizer.built:
            return (float(np.asarray(optimizer.dynamic_scale.value)), int(optimizer.dynamic_growth_steps),
                    int(np.asarray(optimizer.step_counter.value)))
        return float(optimizer.initial_scale), int(optimizer.dynamic_growth_steps), 0
    return 2.0**15, 2000, 0


class KerasOptimizerState(NamedTuple):
    """A Keras optimizer's variables as optax state; its learning rate (when a variable, not a
    schedule) sits in `hyperparams`, where `Trainer.learning_rate` reads and sets it."""

    variables: list[Any]
    hyperparams: dict[str, Any]


def from_keras(optimizer: Any, trainable_variables: Any) -> optax.GradientTransformation:
    """A Keras 3 optimizer object as an optax transformation that runs Keras' own update
    (`stateless_apply`: the same formulas, weight decay, clipping, EMA and iteration count as
    `model.fit`), for a Keras model whose trainable variables are `trainable_variables` (the
    parameters are then the list of their values, in that order).

    Raises:
      ValueError: the optimizer accumulates gradients itself (`gradient_accumulation_steps`):
        its micro-steps are averaged without their sample counts.
    """
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            f"the Keras optimizer {type(optimizer).__name__} has gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}: Keras averages micro-steps without weighting them by their "
            "sample counts, which is not the single-device step; leave it unset and pass "
            f"`ls.Trainer(..., gradient_accumulation_steps={optimizer.gradient_accumulation_steps})`, which is.")
    if not optimizer.built:
        optimizer.build(list(trainable_variables))
    built_for = len(getattr(optimizer, "_trainable_variables", trainable_variables))  # what Keras checks too
    lr_at = _learning_rate_index(optimizer)

    def init(params: Any) -> KerasOptimizerState:
        values = [held(v.value) for v in optimizer.variables]
        hyper = {} if lr_at is None else {"learning_rate": values.pop(lr_at)}
        return KerasOptimizerState(values, hyper)

    def update(grads: Any, state: KerasOptimizerState, params: Any = None) -> tuple[Any, KerasOptimizerState]:
        if built_for != len(grads):  # traced with the train step, before any step (evaluate may go on, as in Keras)
            raise ValueError(
                f"the Keras optimizer was built for {built_for} trainable variables and the model now has "
                f"{len(grads)}: a layer's `trainable` changed after `compile`. As in Keras, call "
                "`model.compile(...)` again after changing `trainable`, with a new optimizer object.")
        values = list(state.variables)
        if lr_at is not None:
            values.insert(lr_at, state.hyperparams["learning_rate"])
        new_params, new_values = optimizer.stateless_apply(values, list(grads), list(params))
        new_values = list(new_values)
        hyper = {} if lr_at is None else {"learning_rate": new_values.pop(lr_at)}
        return [n - p for n, p in zip(new_params, params)], KerasOptimizerState(new_values, hyper)

    return optax.GradientTransformation(init, update)  # type: ignore[arg-type]


def keras_state_owners(optimizer: Any, trainable_variables: Any) -> list[int | None]:
    """For each of a Keras optimizer's variables as `from_keras` keeps them (the learning rate
    apart), the index of the trainable variable it belongs to (Keras names it after the variable's
    path: ``adam/dense_kernel_momentum``), or None (the iteration count)."""
    by_path = {v.path.replace("/", "_"): i for i, v in enumerate(trainable_variables)}
    owners: list[int | None] = []
    for v in keras_state_variables(optimizer):
        rest = v.path.split("/", 1)[-1]
        owner = max((p for p in by_path if rest.startswith(p + "_")), key=len, default=None)
        owners.append(None if owner is None else by_path[owner])
    return owners


def keras_slots(optimizer: Any, trainable_variables: Any) -> Slots:
    """How a Keras optimizer's state (its variables, as `from_keras` keeps them) follows the
    trainable variables: `lockstep.sharding`'s `Slots`, each slot laid out as the variable it
    belongs to (`keras_state_owners`), the iteration count and the learning rate as the rest."""
    owners = keras_state_owners(optimizer, trainable_variables)

    def slots(opt_state: Any, mapped: Any, per_param: Any, other: Any) -> Any:
        def keras(state: Any, _: Any) -> Any:
            return KerasOptimizerState([other if i is None else per_param[i] for i in owners],
                                       {k: other for k in state.hyperparams})
        return jax.tree.map(keras, opt_state, mapped, is_leaf=lambda x: isinstance(x, KerasOptimizerState))
    return slots


def keras_state_variables(optimizer: Any) -> list[Any]:
    """A Keras optimizer's variables as `from_keras` keeps them in its state: the learning rate apart."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    variables = list(optimizer.variables)
    lr_at = _learning_rate_index(optimizer)
    if lr_at is not None:
        variables.pop(lr_at)
    return variables


def is_keras_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is a Keras 3 optimizer object."""
    return is_keras(optimizer) and hasattr(optimizer, "stateless_apply")


def _learning_rate_index(optimizer: Any) -> int | None:
    return next((i for i, v in enumerate(optimizer.variables) if v.path.rsplit("/", 1)[-1] == "learning_rate"),
                None)


def to_keras(optimizer: Any, opt_state: Any) -> None:
    """Writes the Keras optimizer state inside `opt_state` (host arrays) into `optimizer`'s own
    variables (iterations, moments, learning rate), so the Keras model holds what was trained:
    `model.save` and a later `fit` continue from it, as after Keras' own `fit`. Nothing to do
    for `optimizer` None (an optax one) or no state yet."""
    if optimizer is None or opt_state is None:
        return
    _loss_scale_to_keras(optimizer, opt_state)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    stack = [opt_state]
    while stack:
        node = stack.pop()
        if isinstance(node, KerasOptimizerState):
            values = list(node.variables)
            lr_at = _learning_rate_index(optimizer)
            if lr_at is not None:
                values.insert(lr_at, node.hyperparams["learning_rate"])
            for v, value in zip(optimizer.variables, values):
                v.assign(held(value))
            return
        if isinstance(node, (tuple, list)):
            stack.extend(node)


def _loss_scale_to_keras(optimizer: Any, opt_state: Any) -> None:
    """A Keras `LossScaleOptimizer`'s scale and its count of finite steps since the scale last
    changed, from lockstep's loss-scaling state (built first if Keras never ran it)."""
    if not (hasattr(optimizer, "inner_optimizer") and hasattr(optimizer, "dynamic_growth_steps")):
        return
    scale, good = getattr(opt_state, "scale", None), getattr(opt_state, "good_steps", None)
    if scale is None or good is None:
        return
    if not optimizer.built:
        optimizer.build(list(optimizer.inner_optimizer._trainable_variables))  # the inner one is built: kept
    optimizer.dynamic_scale.assign(np.asarray(scale, np.float32))
    optimizer.step_counter.assign(np.asarray(good).astype(optimizer.step_counter.dtype))


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
