"""`DataAdapter`: what `fit` / `evaluate` / `predict` and distributed datasets ask of any input
they accept — the first batch, the batches of a pass from an offset (each worker reading only its
rows, or its own pipeline), label checks, the iterator state for backups. `Batches`,
`IndexedBatches`, `TFDatasetBatches`, `WorkerPipeline`, `IterableBatches` (any iterable of
batches) and the distributed dataset are adapters; `adapt` makes one.

>>> import numpy as np
>>> data = IterableBatches([(np.zeros((2, 3)), np.zeros(2))] * 3)
>>> data.first()[0].shape, len(list(data.host_pass(None, start=1)))
((2, 3), 2)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..engine import padded_per_replica

if TYPE_CHECKING:
    from ..engine import DistributedBatch, Engine, ResidentBatch


class DataAdapter:
    """Any input `fit` / `evaluate` / `predict` or a distributed dataset accepts, as they read it."""

    #: each worker reads its own batches (a per-worker pipeline), not its rows of global batches
    per_worker: bool = False
    #: read by position: a pass starts at any batch without reading the ones before (arrays, Grain `MapDataset`s)
    by_index: bool = False
    #: its batches pass whole through this host, where their labels can be checked
    host_labels: bool = True
    #: the global batch size when the adapter batches samples itself, else None
    batch_size: int | None = None
    #: reading a batch runs the user's code (a `keras.utils.PyDataset`'s `__getitem__`, which may
    #: draw random numbers): no batch is read that Keras' loops would not read
    user_reads: bool = False

    def first(self) -> Any:
        """The first batch (its shapes build the model); no pass is used up."""
        raise NotImplementedError

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterable[Any]:
        """The host batches (or `BatchRows`) of pass `epoch` (None: the next one) from batch `start`
        on; a per-worker pipeline resumes from its iterator `state` instead."""
        raise NotImplementedError

    def distributed(self, engine: "Engine", epoch: int | None = None, start: int = 0, state: str | None = None,
                    fixed_padding: bool = False) -> Iterator["DistributedBatch"]:
        """Pass `epoch` from batch `start`, placed on `engine`'s mesh. With `fixed_padding`, every
        batch of a by-index source is padded to the full batch's shape (one compiled step)."""
        padded = None
        if fixed_padding and self.by_index and self.batch_size is not None:
            padded = padded_per_replica(self.batch_size, engine.num_replicas) * engine.num_replicas
        return engine.distributor.distribute(self.host_pass(epoch, start, state), self.per_worker, padded)

    def resident_pass(self, engine: "Engine", epoch: int, start: int = 0,
                      ahead: bool = False) -> Iterator["ResidentBatch"] | None:
        """Pass `epoch` from batch `start` as batches whose rows stay on `engine`'s devices (see
        `lockstep.engine._resident`), for in-memory data that fits there; else None. `ahead`: the
        next pass will be asked for too (it may be placed in the background meanwhile)."""
        return None

    def new_fit(self) -> None:
        """A `fit` begins to read: passes drawn from a global random state are drawn anew (Keras
        draws every pass), even those numbered as a pass of an earlier fit."""

    def release(self) -> None:
        """Lets go of a pass placed ahead that was not asked for (`fit` calls it as it ends)."""

    def loop_begins(self) -> None:
        """An epoch of a loop (of `fit`, an `evaluate` or validation, a `predict`) begins to read this
        data, on the loop's thread: a `keras.utils.PyDataset`'s `on_epoch_begin`, as in Keras."""

    def loop_ended(self) -> None:
        """That epoch read what it was to read (its steps, or to the data's end; not stopped by a
        callback): a `keras.utils.PyDataset`'s `on_epoch_end`, as in Keras."""

    def taken(self, epoch: int, index: int) -> None:
        """Batch `index` of pass `epoch` goes to training now (`fit` calls it on its own thread, batch
        by batch): arrays shuffled in batches draw there what Keras' fit draws for that batch."""

    def with_check(self, check: Callable[[Any, int], None], labels: bool = True) -> "DataAdapter":
        """The same data, whose host batches `check(batch, index)` sees as they pass (`labels`: the
        check reads their labels)."""
        return self

    def iterator_state(self) -> str | None:
        """The state of the pass in progress's iterator (a Grain pipeline's), for backups."""
        return None

    def order_state(self, epoch: int) -> dict[str, Any] | None:
        """For backups, where the random state that draws pass `epoch`'s order stands (arrays
        shuffled from NumPy's global state, `GlobalOrders`), else None."""
        return None

    def restore_order(self, epoch: int, state: dict[str, Any]) -> None:
        """Takes up a backup's `order_state` at pass `epoch`."""

    def whole(self) -> Any:
        """All the data as one batch when it is in memory (arrays: its labels are checked at once), else None."""
        return None

    def belongs_to(self, engine: "Engine") -> bool:
        """Whether `engine` may read this data (a distributed dataset is bound to its own)."""
        return True


class IterableBatches(DataAdapter):
    """Any iterable of batches: each pass iterates it again (a generator or iterator: one pass)."""

    def __init__(self, data: Iterable[Any], per_worker: bool = False,
                 check: Callable[[Any, int], None] | None = None):
        self.data = data
        self.per_worker = per_worker
        self._check = check
        self.one_shot = isinstance(data, Iterator)
        self._head: list[Any] = []  # a one-shot source's first batch, read by `first`
        self.used_up = False  # a one-shot source ran to its end

    def first(self) -> Any:
        if self.one_shot:
            if not self._head:
                self._head = [next(self.data, None)]  # type: ignore[call-overload]
            return self._head[0]
        return next(iter(self.data), None)

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterator[Any]:
        head, self._head = [b for b in self._head if b is not None], []
        batches = itertools.chain(head, self.data) if self.one_shot else iter(self.data)
        for i, batch in enumerate(itertools.islice(batches, start, None), start=start):
            if self._check is not None:
                self._check(batch, i)
            yield batch
        self.used_up = self.one_shot

    def with_check(self, check: Callable[[Any, int], None], labels: bool = True) -> "IterableBatches":
        out = IterableBatches(self.data, self.per_worker, check)
        out._head = self._head
        return out


class ReplicaBatches:
    """Per-replica batches as a worker's batches: TF's `distribute_datasets_from_function`
    contract, where each element is one replica's batch (batched with
    ``ctx.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)``) and a worker's step takes one element
    for each of its `replicas` local replicas, concatenated here; a last step with fewer elements
    is shorter (its replicas without one hold padding). Elements are read as NumPy (tf.data's
    tensors too). A one-shot source (an iterator) stays one-shot.

    >>> import numpy as np
    >>> [b.tolist() for b in ReplicaBatches([np.arange(2), np.arange(2, 4), np.arange(4, 5)], replicas=2)]
    [[0, 1, 2, 3], [4]]
    >>> len(ReplicaBatches([np.arange(2)] * 5, replicas=2))
    3
    """

    def __new__(cls, data: Iterable[Any], replicas: int) -> Any:
        if isinstance(data, Iterator):  # one-shot: the groups are a one-shot iterator too
            return _groups(data, replicas)
        return super().__new__(cls)

    def __init__(self, data: Iterable[Any], replicas: int):
        self.data = data
        self.replicas = replicas

    def __iter__(self) -> Iterator[Any]:
        source = self.data.as_numpy_iterator() if hasattr(self.data, "as_numpy_iterator") else iter(self.data)
        return _groups(source, self.replicas)

    def __len__(self) -> int:
        n = int(self.data.cardinality()) if hasattr(self.data, "cardinality") else len(self.data)  # type: ignore[arg-type]
        if n < 0:
            raise TypeError("this dataset's number of batches is unknown or infinite.")
        return -(-n // self.replicas)


def _groups(source: Iterator[Any], k: int) -> Iterator[Any]:
    """`source`'s elements `k` at a time, each group's leaves (as NumPy) concatenated along rows."""
    import jax
    import numpy as np

    while group := list(itertools.islice(source, k)):
        yield jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *group)


class Regenerated:
    """A generator function given as data: re-iterable, each pass (epoch) calls it anew (a
    generator object given instead is used up after one pass).

    >>> import numpy as np
    >>> def gen():
    ...     yield np.zeros((2, 3)), np.zeros(2)
    >>> data = Regenerated(gen)
    >>> len(list(data)), len(list(data))
    (1, 1)
    """

    def __init__(self, fn: Callable[[], Iterator[Any]]):
        self._fn = fn

    def __iter__(self) -> Iterator[Any]:
        return iter(self._fn())
