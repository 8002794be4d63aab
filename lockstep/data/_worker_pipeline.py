"""`WorkerPipeline`: a worker's own pipeline of batches whose position (iterator state) can be saved."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

from ._adapter import DataAdapter


class WorkerPipeline(DataAdapter):
    """This worker's batches from a Grain `IterDataset` or `DataLoader` (or anything whose iterators
    have Grain's `get_state` / `set_state`), sharded per worker by the user, as Grain does it:
    ``grain.sharding.ShardByJaxProcess()`` for a `DataLoader`, or ``dataset[jax.process_index()::
    jax.process_count()]`` before ``to_iter_dataset()``. Each worker's batches go to its own
    replicas (`strategy.distribute_datasets_from_function`'s rules: per step, the workers agree on
    a padded size, a worker that ran out sends padding only), and `BackupAndRestore` saves each
    worker's iterator state, so a resume sets it rather than reading the consumed batches again.
    `fit`, `evaluate` and `predict` make one from a Grain `IterDataset` / `DataLoader` given as `x`.

    >>> import lockstep as ls
    >>> class Source:  # an iterable whose iterators have Grain's state methods
    ...     def __iter__(self): return Counter()
    >>> class Counter:
    ...     i = 0
    ...     def __next__(self):
    ...         if self.i == 3: raise StopIteration
    ...         self.i += 1; return [float(self.i)]
    ...     def get_state(self): return {"i": self.i}
    ...     def set_state(self, s): self.i = s["i"]
    >>> it = ls.data.WorkerPipeline(Source()).iterator()
    >>> next(it), it.state()
    ([1.0], '{"i": 1}')
    >>> list(ls.data.WorkerPipeline(Source()).iterator(state='{"i": 1}'))
    [[2.0], [3.0]]
    """

    @staticmethod
    def accepts(x: Any) -> bool:
        """Whether `x` is a Grain `IterDataset` or `DataLoader` (an iterable of Grain's without random access)."""
        return (type(x).__module__.startswith("grain") and hasattr(x, "__iter__")
                and not (hasattr(x, "__getitem__") and hasattr(x, "__len__")))

    per_worker = True

    def __init__(self, source: Any, check: Callable[..., None] | None = None):
        self.source = source
        self._check = check
        self._current: PipelineIterator | None = None  # the pass in progress

    def with_check(self, check: Callable[..., None], labels: bool = True) -> "WorkerPipeline":
        """The same pipeline, whose batches `check(batch, index)` sees as they pass."""
        return WorkerPipeline(self.source, check)

    def first(self) -> Any:
        return next(self.iterator(), None)

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterator[Any]:
        """A new pass of this worker's batches: from its iterator `state` when given (a resume),
        else from batch `start` (the batches before it read again)."""
        self._current = self.iterator(state)
        return self._current if state is not None else itertools.islice(self._current, start, None)

    def iterator_state(self) -> str | None:
        return None if self._current is None else self._current.state()

    def iterator(self, state: str | None = None) -> "PipelineIterator":
        """A new pass; from `state` (a `PipelineIterator.state()`) when given."""
        return PipelineIterator(iter(self.source), self._check, state)

    def __iter__(self) -> Iterator[Any]:
        return self.iterator()


class PipelineIterator:
    """An iterator of a `WorkerPipeline` that knows its state after the last batch it gave."""

    def __init__(self, it: Any, check: Callable[..., None] | None, state: str | None):
        if not (callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))):
            raise TypeError(f"the pipeline's iterator ({type(it).__name__}) has no get_state / set_state: "
                            "its position cannot be saved.")
        self._it = it
        self._check = check
        self._bytes = isinstance(it.get_state(), bytes)  # a DataLoader's iterator: JSON bytes; a dataset's: a dict
        self.count = 0  # batches given
        if state is not None:
            try:
                it.set_state(state.encode() if self._bytes else json.loads(state))
            except (IndexError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"the pipeline's position saved in the backup ({state[:200]}) cannot be set on this "
                                 f"pipeline: {type(e).__name__}: {e} (did the dataset change since the backup?)") from e

    def state(self) -> str:
        """The state after the last batch given, as a string (JSON)."""
        s = self._it.get_state()
        return s.decode() if isinstance(s, bytes) else json.dumps(s, default=lambda v: v.item())  # NumPy numbers

    def __iter__(self) -> "PipelineIterator":
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        if self._check is not None:
            self._check(batch, self.count)
        self.count += 1
        return batch
