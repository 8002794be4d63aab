"""`PyDatasetBatches`: a `keras.utils.PyDataset` read as Keras' `fit` reads it — batch `i` is
``dataset[i]``, the order of the batches shuffled on every pass when `fit`'s `shuffle` is on
(lockstep draws the permutation from its seed and the pass number, so every worker reads the
same order; with `seed=None`, as Keras does, from Python's global random state after the pass's
`on_epoch_begin`: worker 0's), and the dataset's `on_epoch_begin` / `on_epoch_end` called around
each epoch of the loops that read it (`loop_begins` / `loop_ended`: a `fit` epoch of
`steps_per_epoch` may end in the middle of a pass), as Keras calls them.

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
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._keras_kind import defined_in_keras
from ._adapter import DataAdapter
from ._global_orders import GlobalOrders


class PyDatasetBatches(DataAdapter):
    """A Keras `PyDataset` of global batches, read by index (see the module docstring)."""

    by_index = True
    user_reads = True

    def __init__(self, dataset: Any, shuffle: bool = False, seed: int | None = 0,
                 check: Callable[[Any, int], None] | None = None):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0  # the next pass's number, when a pass does not say
        self._check = check
        n = self._num_batches()  # seed None: the orders drawn as Keras draws them (one per pass, every view)
        self._global = GlobalOrders(n, "python") if shuffle and seed is None and n is not None else None
        self._first: Any = None  # the batch `keras_start` read
        #: each loop preceded by an `on_epoch_end`, as Keras' fit validates on a PyDataset (each
        #: validation `evaluate` of the fit's iterator ends the previous pass again first)
        self.ends_before_each_pass = False

    @staticmethod
    def accepts(x: Any) -> bool:
        return any(c.__name__ == "PyDataset" and defined_in_keras(c) for c in type(x).__mro__)

    def _num_batches(self) -> int | None:
        try:
            return self.dataset.num_batches
        except NotImplementedError:
            return None

    def first(self) -> Any:
        if self._first is None:
            self._first = self.dataset[0]
        return self._first

    def keras_start(self, unbuilt: bool, end: bool = True) -> None:
        """What Keras' loops do with the dataset before they start: on a model that is not built
        (or whose compiled metrics are not), a pass that builds it on its first batch (the dataset's
        `on_epoch_begin`, its batches shuffled with `shuffle`, Python's global random state, this
        worker's; the first read, `first()` from then on); then `on_epoch_end`, built or not where
        `end` (`fit`, `evaluate`; `predict` only after such a pass)."""
        if unbuilt:
            if hasattr(self.dataset, "on_epoch_begin"):
                self.dataset.on_epoch_begin()
            n = self._num_batches()
            order = list(range(1 if n is None else n))
            if self.shuffle and n is not None:
                random.shuffle(order)
            self._first = self.dataset[order[0]]
        if (unbuilt or end) and hasattr(self.dataset, "on_epoch_end"):
            self.dataset.on_epoch_end()

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterator[Any]:
        """Pass `epoch`'s batches from `start`, the order drawn at once (on the calling thread, as
        the pass opens: batches may be read ahead on another)."""
        if epoch is None:
            epoch, self.epoch = self.epoch, self.epoch + 1
        n = self._num_batches()
        order: Any = itertools.count() if n is None else range(n)
        if self._global is not None:
            order = self._global.order(epoch)
        elif self.shuffle and n is not None:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        return self._read(order, start)

    def _read(self, order: Any, start: int) -> Iterator[Any]:
        for i, index in enumerate(itertools.islice(order, start, None), start=start):
            batch = self.dataset[int(index)]
            batch = tuple(batch) if isinstance(batch, list) else batch  # Keras takes a list as (x, y, ...)
            if self._check is not None:
                self._check(batch, i)
            yield batch

    def loop_begins(self) -> None:
        if self.ends_before_each_pass and hasattr(self.dataset, "on_epoch_end"):
            self.dataset.on_epoch_end()
        if hasattr(self.dataset, "on_epoch_begin"):
            self.dataset.on_epoch_begin()

    def loop_ended(self) -> None:
        if hasattr(self.dataset, "on_epoch_end"):
            self.dataset.on_epoch_end()

    def with_check(self, check: Callable[[Any, int], None], labels: bool = True) -> "PyDatasetBatches":
        out = PyDatasetBatches(self.dataset, self.shuffle, self.seed, check)
        out.epoch, out._first, out.ends_before_each_pass = self.epoch, self._first, self.ends_before_each_pass
        out._global = self._global  # one draw a pass, whichever view reads it
        return out

    def order_state(self, epoch: int) -> dict[str, Any] | None:
        return None if self._global is None else self._global.state(epoch)

    def restore_order(self, epoch: int, state: dict[str, Any]) -> None:
        if self._global is not None:
            self._global.restore(epoch, state)
