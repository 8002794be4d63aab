"""`PyDatasetBatches`: a `keras.utils.PyDataset` read as Keras' `fit` reads it — batch `i` is
``dataset[i]``, the order of the batches shuffled on every pass when `fit`'s `shuffle` is on
(lockstep draws the permutation from its seed and the pass number, so every worker reads the
same order), and the dataset's `on_epoch_begin` / `on_epoch_end` called around each pass.

>>> import numpy as np
>>> class Squares:  # a PyDataset's face: __getitem__ and num_batches
...     num_batches = 4
...     def __getitem__(self, i):
...         return np.full((2, 1), i * i), np.zeros(2)
>>> [int(b[0][0, 0]) for b in PyDatasetBatches(Squares()).host_pass(0)]
[0, 1, 4, 9]
>>> sorted(int(b[0][0, 0]) for b in PyDatasetBatches(Squares(), shuffle=True).host_pass(0))
[0, 1, 4, 9]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._adapter import DataAdapter


class PyDatasetBatches(DataAdapter):
    """A Keras `PyDataset` of global batches, read by index (see the module docstring)."""

    by_index = True

    def __init__(self, dataset: Any, shuffle: bool = False, seed: int = 0,
                 check: Callable[[Any, int], None] | None = None):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0  # the next pass's number, when a pass does not say
        self._check = check

    @staticmethod
    def accepts(x: Any) -> bool:
        return any(c.__name__ == "PyDataset" and c.__module__.split(".")[0] == "keras" for c in type(x).__mro__)

    def _num_batches(self) -> int | None:
        try:
            return self.dataset.num_batches
        except NotImplementedError:
            return None

    def first(self) -> Any:
        return self.dataset[0]

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterator[Any]:
        if epoch is None:
            epoch, self.epoch = self.epoch, self.epoch + 1
        n = self._num_batches()
        order: Any = itertools.count() if n is None else range(n)
        if self.shuffle and n is not None:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        if hasattr(self.dataset, "on_epoch_begin"):
            self.dataset.on_epoch_begin()
        for i, index in enumerate(itertools.islice(order, start, None), start=start):
            batch = self.dataset[int(index)]
            batch = tuple(batch) if isinstance(batch, list) else batch  # Keras takes a list as (x, y, ...)
            if self._check is not None:
                self._check(batch, i)
            yield batch
        if hasattr(self.dataset, "on_epoch_end"):
            self.dataset.on_epoch_end()

    def with_check(self, check: Callable[[Any, int], None], labels: bool = True) -> "PyDatasetBatches":
        out = PyDatasetBatches(self.dataset, self.shuffle, self.seed, check)
        out.epoch = self.epoch
        return out
