"""`Lending`: Keras variables made to hold the training state's arrays as they lie on the devices
(no copy), again after every step that takes the arrays over.

In Keras' own `fit` the variables are the training state; lockstep's trainer holds the state, and
its Keras variables (the model's, the optimizer's) hold the same buffers, lent, so that the device
holds one copy. Keras' `assign` converts, checks and places each value (microseconds a variable), and
lays it out as the variable's layout says (a copy, where the state lies otherwise: a ZeRO-sharded
moment of a replicated variable); a `Lending` sets a variable of the value's dtype and shape
straight to the very array, wherever it lies.

>>> import keras
>>> import numpy as np
>>> v = keras.Variable(np.zeros(2, np.float32))
>>> lending, x = Lending([v]), keras.ops.ones(2)
>>> lending.lend([x])[0] is x, v.numpy().tolist()
(True, [1.0, 1.0])
>>> y = keras.ops.full(2, 3.0)
>>> lending.lend([y])[0] is y, v.numpy().tolist()
(True, [3.0, 3.0])
"""

from __future__ import annotations

from typing import Any


class Lending:
    """Lends `variables` (Keras variables) values, one each, in order."""

    def __init__(self, variables: list[Any]):
        self.variables = variables

    def lend(self, values: list[Any], copies: bool = True) -> list[Any]:
        """The variables made to hold `values`, each the very array (a variable given None keeps
        what it holds); a value of another dtype or shape, or given to an NNX variable (which keeps
        a second reference), is assigned: Keras converts it and lays it out, a copy where it lies
        otherwise (`copies=False`: such a variable keeps what it holds). Returns what each holds."""
        nnx = _nnx()
        for v, x in zip(self.variables, values):
            if x is None:
                continue
            if not nnx and _fits(v._value, x):
                v._value = x
            elif copies or _lies_as(v._value, x):
                v.assign(x)
        return [v._value for v in self.variables]

    def takers(self, values: list[Any]) -> list[Any]:
        """The variables that ``lend(values, copies=False)`` makes hold their values (`values` may
        be shapes with shardings: those it would make hold arrays so laid out)."""
        nnx = _nnx()
        return [v for v, x in zip(self.variables, values)
                if x is not None and (_fits(v._value, x) and (not nnx or _lies_as(v._value, x)))]


def _nnx() -> bool:
    import keras

    return bool(keras.config.is_nnx_enabled())


def _fits(held: Any, x: Any) -> bool:
    return held is not None and x.dtype == held.dtype and tuple(x.shape) == tuple(held.shape)


def _lies_as(held: Any, x: Any) -> bool:
    """Whether the array `held` lies as `x` does (so that Keras' `assign` keeps `x` itself)."""
    mine, theirs = getattr(held, "sharding", None), getattr(x, "sharding", None)
    return mine is None or theirs is None or mine is theirs or mine.is_equivalent_to(theirs, len(held.shape))
