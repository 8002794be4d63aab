"""Distributed datasets: `DistributedDataset`, the iterable that `experimental_distribute_dataset`
and `distribute_datasets_from_function` return (the engine's `BatchDistributor` places each
batch), and `InputContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..data import DataAdapter
from ..engine import DistributedBatch, Engine


class InputContext:
    """What a per-worker input function needs to know, as in `tf.distribute.InputContext`.

    >>> import lockstep as ls
    >>> ctx = ls.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    >>> ctx.get_per_replica_batch_size(64)
    8
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync`.

        Raises:
          ValueError: `global_batch_size` does not divide by the number of replicas.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"`global_batch_size` must be a multiple of num_replicas_in_sync="
                f"{self.num_replicas_in_sync}, got global_batch_size={global_batch_size}."
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self.input_pipeline_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class DistributedDataset(DataAdapter):
    """An iterable of distributed batches.

    Made by `experimental_distribute_dataset` (every worker iterates the same *global* batches
    and keeps its replicas' rows) or by `distribute_datasets_from_function` (each worker has its
    own pipeline of *local* batches; per step, the workers agree on a padded size, and a worker
    whose pipeline ran out contributes a batch of padding only, so all take the same steps).
    `fit` / `evaluate` / `predict` take it as it is: it is the data adapter of its source, bound to
    its strategy's engine.
    """

    def __init__(self, engine: Engine, data: DataAdapter):
        self._engine = engine
        self._data = data

    @property
    def extended(self) -> Engine:
        """The engine (a strategy's ``extended``) whose replicas the batches are split over."""
        return self._engine

    @property
    def source(self) -> DataAdapter:
        """The data adapter of the host batches this dataset distributes."""
        return self._data

    @property
    def per_worker(self) -> bool:  # type: ignore[override]
        return self._data.per_worker

    @property
    def by_index(self) -> bool:  # type: ignore[override]
        return self._data.by_index

    @property
    def host_labels(self) -> bool:  # type: ignore[override]
        return self._data.host_labels

    @property
    def batch_size(self) -> int | None:  # type: ignore[override]
        return self._data.batch_size

    def first(self) -> Any:
        return self._data.first()

    def whole(self) -> Any:
        return self._data.whole()

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterable[Any]:
        return self._data.host_pass(epoch, start, state)

    def distributed(self, engine: Engine, epoch: int | None = None, start: int = 0, state: str | None = None,
                    fixed_padding: bool = False) -> Iterator[DistributedBatch]:
        if getattr(self._data, "used_up", False):
            raise ValueError(
                f"this distributed dataset wraps a one-shot {type(getattr(self._data, 'data', self._data)).__name__} "
                "(a generator or iterator) that an earlier pass used up, so a new pass would yield nothing: pass a "
                "re-iterable (a list, lockstep.data.batches, a tf.data dataset, or an object whose `__iter__` starts "
                "a new generator).")
        return self._data.distributed(self._engine, epoch, start, state, fixed_padding)

    def resident_pass(self, engine: Engine, epoch: int, start: int = 0, ahead: bool = False) -> Any:
        return self._data.resident_pass(self._engine, epoch, start, ahead)

    def release(self) -> None:
        self._data.release()

    def new_fit(self) -> None:
        self._data.new_fit()

    def loop_begins(self) -> None:
        self._data.loop_begins()

    def loop_ended(self) -> None:
        self._data.loop_ended()

    def taken(self, epoch: int, index: int) -> None:
        self._data.taken(epoch, index)

    def order_state(self, epoch: int) -> dict[str, Any] | None:
        return self._data.order_state(epoch)

    def restore_order(self, epoch: int, state: dict[str, Any]) -> None:
        self._data.restore_order(epoch, state)

    def with_check(self, check: Callable[[Any, int], None], labels: bool = True) -> "DistributedDataset":
        return DistributedDataset(self._engine, self._data.with_check(check, labels))

    def iterator_state(self) -> str | None:
        return self._data.iterator_state()

    def belongs_to(self, engine: Engine) -> bool:
        return engine is self._engine

    def __iter__(self) -> "DistributedIterator":
        """A pass, as a loop of the user's reads it (a `keras.utils.PyDataset`'s epoch hooks around it)."""
        return DistributedIterator(self._loop(self.distributed(self._engine)))

    def _loop(self, batches: Iterator[DistributedBatch]) -> Iterator[DistributedBatch]:
        self._data.loop_begins()
        yield from batches
        self._data.loop_ended()

    def __len__(self) -> int:
        """The number of batches (a `TypeError` where the source does not know it, as for a generator)."""
        return len(getattr(self._data, "data", self._data))  # type: ignore[arg-type]


class DistributedIterator(Iterator[DistributedBatch]):
    """An iterator over a distributed dataset's batches, with TF's `get_next` and
    `get_next_as_optional` (every worker gets the same answer: the workers agree on each step).

    >>> import lockstep as ls, numpy as np
    >>> s = ls.MirroredStrategy(2)
    >>> it = iter(s.experimental_distribute_dataset(ls.data.batches(np.arange(6.0), 4)))
    >>> seen = []
    >>> while (optional := it.get_next_as_optional()).has_value():
    ...     seen.append(optional.get_value().num_real)
    >>> seen
    [4, 2]
    """

    def __init__(self, batches: Iterator[DistributedBatch]):
        self._batches = batches

    def __next__(self) -> DistributedBatch:
        return next(self._batches)

    def close(self) -> None:
        """Stops the pass early (its prefetching thread too)."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()

    def get_next(self) -> DistributedBatch:
        """The next batch (`StopIteration` at the end, as TF's `OutOfRangeError`)."""
        return next(self._batches)

    def get_next_as_optional(self) -> "OptionalBatch":
        """The next batch, or an empty `OptionalBatch` at the end (TF's `tf.experimental.Optional`)."""
        return OptionalBatch(next(self._batches, None))


class OptionalBatch:
    """A batch or nothing, as TF's `tf.experimental.Optional`: `has_value()`, `get_value()`."""

    def __init__(self, value: DistributedBatch | None):
        self._value = value

    def has_value(self) -> bool:
        return self._value is not None

    def get_value(self) -> DistributedBatch:
        if self._value is None:
            raise ValueError("this optional holds no batch (the dataset has ended): check `has_value()` first.")
        return self._value
