"""Distributed datasets: global batches split over replicas (padded, masked) and placed on devices.

`BatchDistributor` turns host batches into `DistributedBatch`es with the layout functions of
`_layout` (the same padding and masks for global batches and per-worker pipelines);
`DistributedDataset` is the iterable that `experimental_distribute_dataset` and
`distribute_datasets_from_function` return.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._cross_replica import AXIS, allgather_sizes, batch_digests
from ._layout import BatchRows, StepInfo, batch_length, pad_and_mask, padded_per_replica, rows_digest, to_numpy
from ._values import DistributedBatch

if TYPE_CHECKING:
    from ._strategy import Strategy


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


class BatchDistributor:
    """Places batches on a strategy's mesh: each worker keeps only its replicas' rows."""

    def __init__(self, strategy: "Strategy", mesh: Mesh):
        self._strategy = strategy
        self.replicated = NamedSharding(mesh, P())
        self.split = NamedSharding(mesh, P(AXIS))
        devices = list(mesh.devices.flat)
        self.num_replicas = len(devices)
        me = jax.process_index()
        self.local_replica_ids = [i for i, d in enumerate(devices) if d.process_index == me]
        per_process = collections.Counter(d.process_index for d in devices)
        self.replicas_per_process = [per_process[p] for p in range(jax.process_count())]
        self._counts: dict[int, jax.Array] = {}
        self._layouts: dict[Any, tuple[jax.Array, StepInfo, jax.Array]] = {}

    def put_replicated(self, x: Any) -> Any:
        """`x` (a pytree) copied to every device."""
        return jax.device_put(x, self.replicated)

    def _count(self, n: int) -> jax.Array:
        """A step's real sample count as a replicated scalar (cached: full batches repeat it)."""
        arr = self._counts.get(n)
        if arr is None:
            if len(self._counts) > 64:
                self._counts.clear()
            arr = self._counts[n] = self.put_replicated(np.float32(n))
        return arr

    def place_split(self, local: list[np.ndarray], global_rows: int) -> list[jax.Array]:
        """Global arrays split over replicas from this process's rows (all rows when single-process)."""
        if jax.process_count() == 1:
            return jax.device_put(local, self.split)
        return [jax.make_array_from_process_local_data(self.split, x, (global_rows, *x.shape[1:])) for x in local]

    def global_batch(self, batch: Any, padded_size: int | None = None) -> DistributedBatch:
        """One global batch (the same on every worker), padded to `padded_size` rows at least.

        `batch` is the batch's arrays, or a `BatchRows`, of which this worker reads only the rows
        of its own replicas.
        """
        if isinstance(batch, BatchRows):
            n = batch.num_real
        else:
            leaves, treedef = jax.tree.flatten(batch)
            if not leaves:
                raise ValueError(f"`batch` must hold at least one array, got {batch!r}.")
            leaves = [to_numpy(x) for x in leaves]
            n = batch_length(leaves)
        r = self.num_replicas
        b = padded_per_replica(n, r, padded_size)
        ids = self.local_replica_ids
        lo, hi = ids[0] * b, (ids[-1] + 1) * b  # a process's replicas are contiguous in the mesh
        real = max(min(hi, n) - lo, 0)
        if isinstance(batch, BatchRows):  # read this worker's real rows only, and pad them
            leaves, treedef = jax.tree.flatten(batch.read(lo, lo + real) if real else batch.blank())
            rows, mask = pad_and_mask([to_numpy(x) for x in leaves], real, 0, hi - lo)
        else:
            rows, mask = pad_and_mask(leaves, n, lo, hi)
        key = (lo, hi, n, b)
        layout = self._layouts.get(key)  # full batches repeat one layout: build and place it once
        if layout is None:
            if len(self._layouts) > 64:
                self._layouts.clear()
            layout = self._layouts[key] = (self.place_split([mask], r * b)[0], StepInfo.contiguous(r, b, n),
                                           self._count(n))
        dist = DistributedBatch(self.place_split(rows, r * b), treedef, layout[0], layout[1], self._strategy,
                                layout[2])
        dist.digest = lambda: rows_digest([x[:real] for x in rows], lo)
        return dist

    def local_batches(self, dataset: Iterable[Any]) -> Iterator[DistributedBatch]:
        """Per-worker pipelines: agree on sizes each step; a finished worker sends padding only."""
        it = iter(dataset)
        template: list[np.ndarray] | None = None
        treedef: Any = None
        per_replica = 0
        mine = self.replicas_per_process[jax.process_index()]
        while True:
            batch = next(it, None)
            leaves: list[np.ndarray] = []
            if batch is not None:
                leaves, treedef = jax.tree.flatten(batch)
                leaves = [to_numpy(x) for x in leaves]
                n = batch_length(leaves)
                if template is None:
                    template = [x[:1] for x in leaves]
            else:
                n = 0
            sizes = allgather_sizes(n)
            if not sizes.any():
                return
            if per_replica == 0 and len(sizes) > 1:  # the first step: are the pipelines sharded?
                _check_sharded(leaves, sizes)
            if template is None:
                raise ValueError(f"worker {jax.process_index()}'s pipeline yielded no batch while other workers' "
                                 "did: give every worker at least one batch.")
            per_replica = max(per_replica, *(padded_per_replica(int(k), r)
                                             for k, r in zip(sizes, self.replicas_per_process)))
            rows, mask = pad_and_mask(leaves if n else template, n, 0, mine * per_replica)
            step = StepInfo.of_workers(sizes, self.replicas_per_process, per_replica)
            placed = self.place_split([*rows, mask], step.padded_size)
            dist = DistributedBatch(placed[:-1], treedef, placed[-1], step, self._strategy, self._count(step.num_real))
            start = int(sizes[:jax.process_index()].sum())
            dist.digest = lambda rows=rows, n=n, start=start: rows_digest([x[:n] for x in rows], start)
            yield dist


def _check_sharded(leaves: list[np.ndarray], sizes: np.ndarray) -> None:
    """Per-worker pipelines whose first batches are equal are not sharded: every sample would count
    once per worker. All workers see the same checksums, so all raise together (no hang)."""
    digests, _ = batch_digests(leaves)
    seen: dict[int, int] = {}
    for w, (d, k) in enumerate(zip(digests, sizes)):
        if k and int(d) in seen:
            raise ValueError(
                f"workers {seen[int(d)]} and {w} got the same first batch from their per-worker pipelines: each "
                "worker's pipeline must give its own part of the data, or every sample counts once per worker. Shard "
                "it by worker: grain.sharding.ShardByJaxProcess() for a Grain DataLoader, "
                "dataset[ctx.input_pipeline_id::ctx.num_input_pipelines] for a Grain MapDataset, "
                "dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id) for tf.data (ctx: the InputContext); "
                "or give the global data to fit / experimental_distribute_dataset, which split it.")
        if k:
            seen[int(d)] = w


def _check_same_first_batch(batch: Any) -> None:
    """Every worker iterates the same global batches and keeps its replicas' rows: the first batch
    of a pass must be the same everywhere (a checksum, one small collective; all workers raise
    together)."""
    digests, differ = batch_digests([to_numpy(x) for x in jax.tree.leaves(batch)])
    if differ:
        raise ValueError(
            f"the first batch of this pass differs on worker{'s' if len(differ) > 1 else ''} {differ} from worker 0's "
            f"(checksums {digests}, in worker order): an iterable of global batches must give the same batches on "
            "every worker, which keeps its replicas' rows of each (batches that differ drop some samples and repeat "
            "others). Seed any shuffling the same on every worker; for data that differs per worker, use "
            "strategy.distribute_datasets_from_function.")


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

    def __init__(self, strategy: "Strategy", dataset: Iterable[Any], per_worker: bool = False,
                 padded_size: int | None = None):
        self._strategy = strategy
        self._dataset = dataset
        self._per_worker = per_worker
        self._padded_size = padded_size
        self._used_up = False  # a one-shot source ran to its end

    @property
    def strategy(self) -> "Strategy":
        """The strategy whose replicas the batches are split over."""
        return self._strategy

    @property
    def source(self) -> Iterable[Any]:
        """The iterable of host batches this dataset distributes."""
        return self._dataset

    def with_source(self, dataset: Iterable[Any]) -> "DistributedDataset":
        """The same distribution over another iterable of host batches."""
        return DistributedDataset(self._strategy, dataset, self._per_worker, self._padded_size)

    def __iter__(self) -> Iterator[DistributedBatch]:
        one_shot = isinstance(self._dataset, Iterator)  # a generator or iterator: one pass only
        if one_shot and self._used_up:
            raise ValueError(
                f"this distributed dataset wraps a one-shot {type(self._dataset).__name__} (a generator or "
                "iterator) that an earlier pass used up, so a new pass would yield nothing: pass a re-iterable "
                "(a list, lockstep.data.batches, a tf.data dataset, or an object whose `__iter__` starts a new "
                "generator).")
        distributor = self._strategy.extended.distributor
        if self._per_worker:
            batches = distributor.local_batches(self._dataset)
        else:
            batches = self._distributed(distributor)
            depth = _prefetch_depth(self._strategy.devices)
            if jax.process_count() == 1 and depth > 0:
                batches = _prefetch(batches, depth)
        yield from batches
        self._used_up = one_shot

    def _distributed(self, distributor: BatchDistributor) -> Iterator[DistributedBatch]:
        padded = self._padded_size
        next_rows = getattr(self._dataset, "next_rows", None)  # lockstep's batches: each worker reads its rows
        for i, batch in enumerate(next_rows() if callable(next_rows) else self._dataset):
            if i == 0 and jax.process_count() > 1 and not isinstance(batch, BatchRows):
                _check_same_first_batch(batch)
            dist = distributor.global_batch(batch, padded)
            if padded is None:
                padded = dist.step.padded_size
            yield dist

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]
