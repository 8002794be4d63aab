"""A Keras `JaxLayer` / `FlaxLayer` inside a replica of several: its function's own random draws
(an `rng` it draws from with `jax.random`: Flax's dropout) are the same on every replica, not each
row's draw for the global batch, so a layer whose outputs depend on its `rng` is refused there; one
that takes an `rng` and does not draw with it (a Flax module without dropout) runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.interpreters import partial_eval as pe


def _depends_on(fn: Callable[..., Any], args: tuple[Any, ...], at: int) -> bool:
    """Whether `fn(*args)`'s results depend on its argument `at` (traced alone, the others held)."""
    if not jax.tree.leaves(args[at]):
        return False
    traced = jax.make_jaxpr(lambda rng: fn(*args[:at], rng, *args[at + 1:]))(args[at])
    return any(pe.dce_jaxpr(traced.jaxpr, [True] * len(traced.jaxpr.outvars))[1])


def refusing_drawn_calls(call: Callable[..., Any], replicas: Callable[[], int]) -> Callable[..., Any]:
    """Keras' `JaxLayer.call`, raising where the layer's function uses its `rng` while `replicas()`
    (the replicas of the call being traced; 1 outside one) is more than one."""
    def checked_call(layer: Any, inputs: Any, training: bool = False) -> Any:
        count, fn = replicas(), layer.call_fn
        if count == 1 or "rng" not in layer.call_fn_arguments:
            return call(layer, inputs, training)
        at = layer.call_fn_arguments.index("rng")

        def checked(*args: Any) -> Any:
            if _depends_on(fn, args, at):
                raise ValueError(
                    f"layer {layer.name!r} ({type(layer).__name__}) draws with the `rng` it passes to its JAX function "
                    f"(dropout, noise): those draws would be the same on each of {count} replicas instead of each "
                    "row's draw for the global batch, so the step would not be the one-device step. Draw with Keras "
                    "layers (keras.layers.Dropout, keras.random), which lockstep draws as one device does, or train "
                    "on one replica.")
            return fn(*args)
        layer.call_fn = checked
        try:
            return call(layer, inputs, training)
        finally:
            layer.call_fn = fn
    return checked_call
