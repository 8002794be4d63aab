"""Mixed precision: a dtype policy for the compiled steps, and dynamic loss scaling.

Under ``"mixed_bfloat16"`` / ``"mixed_float16"`` the parameters and the optimizer state stay
float32; the forward and backward passes compute in the low precision (a `FunctionalModel`'s
float parameters and inputs are cast on entry; Keras layers cast by their own dtype policies);
the model's outputs are cast back to float32 before the loss and the metrics, whose states are
float32.

``"mixed_float16"`` scales the loss (float16 gradients underflow otherwise): the scale starts at
2**15, halves on a step whose gradients are not finite, and doubles after 2000 finite steps in
a row (Keras' `LossScaleOptimizer` defaults). The finiteness test reads the gradient after it is
summed over every replica and worker, so a non-finite value on one replica skips the step on all
of them alike: the weights and optimizer state stay as they were, and `skipped` counts it.
The scale lives in the optimizer state (`LossScaleState`), so checkpoints carry it.

>>> import jax.numpy as jnp, optax
>>> opt = with_loss_scaling(optax.sgd(1.0))
>>> state = opt.init({"w": jnp.ones(2)})
>>> _, state = opt.update({"w": jnp.array([1.0, jnp.inf])}, state, {"w": jnp.ones(2)})
>>> float(state.scale), int(state.skipped)
(16384.0, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
_COMPUTE = {"float32": jnp.float32, "mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}


def resolve_policy(dtype_policy: str | None, model_policy: str | None) -> str:
    """The policy the steps use: `dtype_policy` (default ``"float32"``) for a model without one of
    its own (`model_policy` None: a `FunctionalModel`); else the model's own (a Keras model's,
    from `keras.config.set_dtype_policy` or per model).

    Raises:
      ValueError: an unknown policy name, or `dtype_policy` that differs from the model's own
        (Keras layers fix their compute dtype when they are built).
    """
    if dtype_policy is not None and dtype_policy not in POLICIES:
        raise ValueError(f"`dtype_policy` must be one of {POLICIES} (or None), got dtype_policy={dtype_policy!r}.")
    if model_policy is None:
        return dtype_policy or "float32"
    if dtype_policy is not None and dtype_policy != model_policy:
        raise ValueError(
            f"`dtype_policy={dtype_policy!r}` but the Keras model was built with the dtype policy {model_policy!r}: "
            f"Keras layers take their policy when they are created. Call keras.config.set_dtype_policy("
            f"{dtype_policy!r}) before building the model (or pass `dtype=` to it), and leave `dtype_policy` unset.")
    if model_policy not in POLICIES:
        raise ValueError(f"the Keras model's dtype policy {model_policy!r} is not one lockstep trains with: "
                         f"use one of {POLICIES}.")
    return model_policy


def compute_dtype(policy: str) -> Any:
    return _COMPUTE[policy]


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(a: Any) -> Any:
        return a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a
    return jax.tree.map(cast, tree)


def in_precision(apply: Callable[..., Any], policy: str, cast_inputs: bool) -> Callable[..., Any]:
    """`apply(params, x, training)` computing in `policy`'s dtype, its outputs float32.

    With `cast_inputs` (a `FunctionalModel`) the trainable parameters and the inputs are cast to
    the compute dtype on entry (the float32 parameters stay the ones that are differentiated and
    updated); a Keras model casts inside its layers.
    """
    if policy == "float32":
        return apply
    low = compute_dtype(policy)

    def mixed(params: Any, x: Any, training: bool) -> Any:
        if cast_inputs:
            params = {"trainable": _cast_floats(params["trainable"], low), "non_trainable": params["non_trainable"]}
            x = _cast_floats(x, low)
        y, non_trainable, penalty = apply(params, x, training)
        return (_cast_floats(y, jnp.float32), non_trainable,
                None if penalty is None else penalty.astype(jnp.float32))
    return mixed


class LossScaleState(NamedTuple):
    """Optimizer state under dynamic loss scaling: the inner optimizer's, the current scale, finite
    steps since the last change, and steps skipped so far."""

    inner: Any
    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array


def with_loss_scaling(optimizer: optax.GradientTransformation, initial_scale: float = 2.0**15,
                      growth_steps: int = 2000, good_steps: int = 0) -> optax.GradientTransformation:
    """`optimizer` with dynamic loss scaling (from `initial_scale`, `good_steps` finite steps since
    it last changed); `update` takes unscaled gradients (summed over replicas) and skips the step
    — zero updates, the inner state kept — when any is not finite."""

    def init(params: Any) -> LossScaleState:
        return LossScaleState(optimizer.init(params), np.float32(initial_scale), np.int32(good_steps), np.int32(0))

    def update(grads: Any, state: LossScaleState, params: Any = None) -> tuple[Any, LossScaleState]:
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, inner = optimizer.update(safe, state.inner, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        inner = jax.tree.map(lambda new, old: jnp.where(finite, new, old), inner, state.inner)
        grown = state.good_steps + 1 >= growth_steps
        scale = jnp.where(finite, jnp.where(grown, state.scale * 2.0, state.scale),
                          jnp.maximum(state.scale / 2.0, 1.0)).astype(jnp.float32)
        good = jnp.where(finite & ~grown, state.good_steps + 1, 0).astype(jnp.int32)
        skipped = (state.skipped + jnp.where(finite, 0, 1)).astype(jnp.int32)
        return updates, LossScaleState(inner, scale, good, skipped)

    return optax.GradientTransformation(init, update)  # type: ignore[arg-type]


def loss_scale_of(opt_state: Any) -> jax.Array | None:
    """The current loss scale in `opt_state`, or None when the optimizer does not scale."""
    return opt_state.scale if isinstance(opt_state, LossScaleState) else None


def skipped_steps(opt_state: Any) -> int | None:
    """Steps skipped for non-finite gradients so far (host int), or None without loss scaling."""
    return int(np.asarray(opt_state.skipped)) if isinstance(opt_state, LossScaleState) else None
