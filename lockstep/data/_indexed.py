"""`IndexedBatches`: global batches of a random-access source, each worker reading only its rows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ..engine import BatchRows
from ._adapter import DataAdapter


class IndexedBatches(DataAdapter):
    """Global batches of `batch_size` samples of `source`, where `source[i]` is sample `i` (a pytree
    of arrays without the batch axis: ``(x, y)``, a dict, ...), e.g. a `grain.MapDataset` of decoded
    and transformed records.

    The global order is defined once per pass from `seed` and the pass number (as
    `lockstep.data.batches`); the workers take the same steps, and each reads (so decodes and
    transforms) only the samples of its own replicas' rows: over one pass, every sample is read
    once, by one worker. Reading the shapes costs one more read of sample 0 per worker. `fit`,
    `evaluate` and `predict` take a `grain.MapDataset` as `x` (with `batch_size`) and make this;
    `strategy.experimental_distribute_dataset(IndexedBatches(...))` reads per worker too.

    >>> import numpy as np, lockstep as ls
    >>> samples = [(np.float32(i), np.int32(i % 2)) for i in range(5)]
    >>> class Source:
    ...     def __len__(self): return 5
    ...     def __getitem__(self, i): return samples[i]
    >>> [x.tolist() for x, y in ls.data.IndexedBatches(Source(), 2)]
    [[0.0, 1.0], [2.0, 3.0], [4.0]]
    """

    @staticmethod
    def accepts(x: Any) -> bool:
        """Whether `x` is a random-access source of samples this class reads: a `grain.MapDataset`
        or a Grain data source (anything of Grain's with `__len__` and `__getitem__`)."""
        return (type(x).__module__.startswith("grain") and hasattr(x, "__getitem__") and hasattr(x, "__len__")
                and not isinstance(x, (np.ndarray, list, tuple, dict)))

    def __init__(self, source: Any, batch_size: int, shuffle: bool = False, seed: int = 0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got batch_size={batch_size!r}.")
        self.source = source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._n = len(source)
        if self._n < 1:
            raise ValueError(f"the source of samples is empty (len {self._n}).")
        self._blank: Any = None
        self.epoch = 0  # passes begun by `iter()` / `host_pass(None)`

    @property
    def num_samples(self) -> int:
        return self._n

    def __len__(self) -> int:
        return -(-self._n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of pass number `epoch`."""
        if not self.shuffle:
            return np.arange(self._n)
        return np.random.default_rng([self.seed, epoch]).permutation(self._n)

    def read(self, indices: Any) -> Any:
        """Samples `indices` of the source, stacked into a batch."""
        samples = [self.source[int(i)] for i in indices]
        try:
            return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *samples)
        except ValueError as e:  # samples of other structures or shapes: name the first that differs
            first = jax.tree.map(np.shape, samples[0])
            for i, s in zip(indices, samples):
                if jax.tree.map(np.shape, s) != first:
                    raise ValueError(f"sample {int(i)} of the source has shapes {jax.tree.map(np.shape, s)}, sample "
                                     f"{int(indices[0])} has {first}: the samples of a batch must have the same "
                                     "shapes (pad them to one length in a `.map`).") from e
            raise

    def blank(self) -> Any:
        """A batch of one row of zeros with the samples' shapes (sample 0 read once for them)."""
        if self._blank is None:
            self._blank = jax.tree.map(np.zeros_like, self.read([0]))
        return self._blank

    by_index = True
    host_labels = False  # each worker reads only its rows: the labels are never whole on one host

    def first(self) -> Any:
        return self.blank()  # one sample's shapes (zeros): enough to build the model

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterator[BatchRows]:
        """Pass `epoch` (None: the next), each worker reading only its rows."""
        if epoch is None:
            epoch, self.epoch = self.epoch, self.epoch + 1
        return self.rows(epoch, start)

    def rows(self, epoch: int, start: int = 0) -> Iterator[BatchRows]:
        """Batches of pass `epoch` from batch `start` on; a worker reads only the rows it keeps.

        Raises:
          ValueError: the source's length is not the one it had when `fit` began (the order,
            the steps of an epoch and the backups' positions derive from it).
        """
        if len(self.source) != self._n:
            raise ValueError(
                f"the source of samples changed length between passes: {self._n} samples when reading began, "
                f"{len(self.source)} at pass {epoch}. The order and the steps of each epoch are fixed from the length "
                "(Grain would wrap indices past the end, repeating samples, or never read the new ones): keep the "
                "source the same during `fit`, or call `fit` again for the new data.")
        order = self.order(epoch)
        self.blank()
        for i in range(start, len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield BatchRows(len(idx), lambda a, b, idx=idx: self.read(idx[a:b]), self.blank)

    def __iter__(self) -> Iterator[Any]:
        """Whole batches of the next pass (every sample read here: for a look at the data; a
        distributed dataset reads per worker)."""
        for batch in self.host_pass(None):
            yield batch.read(0, batch.num_real)
