"""Distributed datasets: `DistributedDataset`, the iterable that `experimental_distribute_dataset`
and `distribute_datasets_from_function` return (the engine's `BatchDistributor` places each
batch), `InputContext`, and prefetching.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax

from ..engine._engine import Engine
from ..engine._layout import BatchRows
from ..engine._placement import BatchDistributor, DistributedBatch, check_same_first_batch


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


#: Global batches prepared (sliced, padded, placed on the devices) ahead of the step that uses
#: them, in a background thread, so host work overlaps device work. 0 turns it off; unset, it is
#: 2 on accelerators and 0 on CPU devices, where the "device" work runs on the same cores and a
#: second Python thread only contends for them (and for the GIL).
PREFETCH = os.environ.get("LOCKSTEP_PREFETCH")


def _prefetch_depth(devices: Iterable[jax.Device]) -> int:
    if PREFETCH is not None:
        return int(PREFETCH)
    return 0 if all(d.platform == "cpu" for d in devices) else 2


_DONE = object()


def _prefetch(source: Iterator[Any], depth: int) -> Iterator[Any]:
    """Runs `source` in a background thread, `depth` items ahead; errors surface in the consumer."""
    items: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        items.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put((True, _DONE))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            items.put((False, e))

    thread = threading.Thread(target=produce, name="lockstep-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = items.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=5.0)


class DistributedDataset:
    """An iterable of distributed batches.

    Made by `experimental_distribute_dataset` (every worker iterates the same *global* batches
    and keeps its replicas' rows) or by `distribute_datasets_from_function` (each worker has its
    own pipeline of *local* batches; per step, the workers agree on a padded size, and a worker
    whose pipeline ran out contributes a batch of padding only, so all take the same steps).
    """

    def __init__(self, engine: Engine, dataset: Iterable[Any], per_worker: bool = False,
                 padded_size: int | None = None):
        self._engine = engine
        self._dataset = dataset
        self._per_worker = per_worker
        self._padded_size = padded_size
        self._used_up = False  # a one-shot source ran to its end

    @property
    def extended(self) -> Engine:
        """The engine (a strategy's ``extended``) whose replicas the batches are split over."""
        return self._engine

    @property
    def source(self) -> Iterable[Any]:
        """The iterable of host batches this dataset distributes."""
        return self._dataset

    def with_source(self, dataset: Iterable[Any]) -> "DistributedDataset":
        """The same distribution over another iterable of host batches."""
        return DistributedDataset(self._engine, dataset, self._per_worker, self._padded_size)

    def __iter__(self) -> Iterator[DistributedBatch]:
        one_shot = isinstance(self._dataset, Iterator)  # a generator or iterator: one pass only
        if one_shot and self._used_up:
            raise ValueError(
                f"this distributed dataset wraps a one-shot {type(self._dataset).__name__} (a generator or "
                "iterator) that an earlier pass used up, so a new pass would yield nothing: pass a re-iterable "
                "(a list, lockstep.data.batches, a tf.data dataset, or an object whose `__iter__` starts a new "
                "generator).")
        distributor = self._engine.distributor
        if self._per_worker:
            batches = distributor.local_batches(self._dataset)
        else:
            batches = self._distributed(distributor)
            depth = _prefetch_depth(self._engine.mesh.devices.flat)
            if jax.process_count() == 1 and depth > 0:
                batches = _prefetch(batches, depth)
        yield from batches
        self._used_up = one_shot

    def _distributed(self, distributor: BatchDistributor) -> Iterator[DistributedBatch]:
        padded = self._padded_size
        next_rows = getattr(self._dataset, "next_rows", None)  # lockstep's batches: each worker reads its rows
        for i, batch in enumerate(next_rows() if callable(next_rows) else self._dataset):
            if i == 0 and jax.process_count() > 1 and not isinstance(batch, BatchRows):
                check_same_first_batch(batch)
            dist = distributor.global_batch(batch, padded)
            if padded is None:
                padded = dist.step.padded_size
            yield dist

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]
