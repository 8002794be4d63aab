"""`Lending`: Keras variables made to hold the training state's arrays as they lie on the devices
(no copy), again after every step that takes the arrays over.

In Keras' own `fit` the variables are the training state; lockstep's trainer holds the state, and
its Keras variables (the model's, the optimizer's) hold the same buffers, lent, so that the device
holds one copy. Keras' `assign` converts, checks and places each value (microseconds a variable); a
`Lending` assigns once, and later sets the variables that kept the very array straight.

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
        self._kept: list[Any] | None = None  # each variable's sharding where `assign` kept the array given

    def lend(self, values: list[Any]) -> list[Any]:
        """The variables made to hold `values`; returns what each holds (a value itself, or where
        its layout places it elsewhere, Keras' copy)."""
        kept = self._kept
        for i, (v, x) in enumerate(zip(self.variables, values)):
            was = None if kept is None else kept[i]
            if was is not None and ((s := getattr(x, "sharding", None)) is was or s == was) and (
                    x.dtype == v._value.dtype and x.shape == v._value.shape):
                v._value = x  # what `assign` did with the same layout: the array itself
            else:
                v.assign(x)
        if kept is None:
            import keras

            nnx = keras.config.is_nnx_enabled()  # NNX variables keep a second reference: assigned always
            self._kept = [x.sharding if v._value is x and not nnx else None for v, x in zip(self.variables, values)]
        return [v._value for v in self.variables]
