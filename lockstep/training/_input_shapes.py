"""The model's inputs checked on the host: a batch whose samples the model cannot take is a clear
error naming the argument, the batch and the shapes, before any step (not JAX's
``dot_general requires contracting dimensions...`` from inside a compiled step).

Each new per-sample signature (shapes after the batch axis, dtypes) is traced once with
`jax.eval_shape`; signatures the model took are remembered, so a model that takes several (an
LSTM on sequences of varying length) pays one trace each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def _spec(x: Any) -> Any:
    def spec(a: Any) -> jax.ShapeDtypeStruct:
        dtype = getattr(a, "dtype", None)
        return jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype if dtype is None else dtype)
    return jax.tree.map(spec, x)


def _sample_shapes(x: Any) -> Any:
    """Per-sample shapes of `x`'s arrays: a tuple for an array, else a tree of them."""
    leaves, treedef = jax.tree.flatten(x)
    shapes = [tuple(np.shape(a)[1:]) for a in leaves]
    return shapes[0] if treedef.num_nodes == 1 else jax.tree.unflatten(treedef, shapes)


class InputCheck:
    """Per-sample input signatures a model has taken; `check` traces a new one.

    >>> import numpy as np, jax.numpy as jnp
    >>> inputs = InputCheck(lambda p, x: x @ p["w"])
    >>> inputs.check({"w": np.ones((4, 2))}, np.ones((8, 4)), "x")
    >>> inputs.check({"w": np.ones((4, 2))}, np.ones((8, 5)), "validation_data")
    Traceback (most recent call last):
    ...
    ValueError: `validation_data` has samples of shape (5,), which the model cannot take: it took samples of shape (4,) (dot_general requires contracting dimensions to have the same shape, got (5,) and (4,).)
    """

    def __init__(self, apply: Callable[[Any, Any], Any], structure: Callable[[Any], None] | None = None):
        self._apply = apply
        self._structure = structure  # the model's own check of names, count and shapes (Keras' input_spec)
        self._taken: set[Any] = set()
        self._first: Any = None

    def check(self, params: Any, x: Any, arg: str, where: str = "") -> None:
        """Raises ValueError if the model cannot take `x` (a batch of `arg`; `where` says which)."""
        leaves, treedef = jax.tree.flatten(x)
        signature = (treedef, tuple((np.shape(a)[1:], str(getattr(a, "dtype", ""))) for a in leaves))
        if signature in self._taken:
            return
        shapes = _sample_shapes(x)
        if any(np.ndim(a) == 0 for a in leaves):
            raise ValueError(f"`{arg}`{where} holds a scalar where a batch of samples belongs (shapes "
                             f"{jax.tree.map(np.shape, x)}).")
        if self._structure is not None:
            try:
                self._structure(x)
            except ValueError as e:
                raise ValueError(f"`{arg}`{where} does not fit the model's inputs: {e}") from e
        try:
            jax.eval_shape(self._apply, params, _spec(x))
        except (TypeError, ValueError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            took = "" if self._first is None else f": it took samples of shape {self._first}"
            raise ValueError(f"`{arg}`{where} has samples of shape {shapes}, which the model cannot take{took} "
                             f"({why})") from e
        if self._first is None:
            self._first = shapes
        self._taken.add(signature)
