"""Placing data on the mesh: global batches split over the batch axis (padded, masked), each
worker keeping only its replicas' rows (`BatchDistributor`), and the placed batch itself
(`DistributedBatch`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._cross_replica import allgather_sizes, axis_names, batch_digests
from ._batch_rows import (BatchRows, StepInfo, aligned_take, batch_checksum, batch_length, pad_and_mask,
                          padded_per_replica, rows_digest, to_numpy)
from ._prefetch import prefetch, prefetch_depth


class DistributedBatch:
    """One global batch split across replicas, padded to equal shapes, with a per-sample mask.

    Inside `strategy.run` the function receives `data`'s structure with each replica's rows
    (padding included); the mask is on `get_replica_context().mask`.

    Args:
      leaves: the padded global arrays, split over replicas.
      treedef: the structure the dataset yielded.
      mask: (padded rows,) float32, 1.0 for real rows, split like the leaves.
      step: the host-side layout of the batch.
      engine: the engine whose devices hold it.
      count: the step's real sample count, a replicated float32 scalar (losses divide by it).
    """

    __slots__ = ("_leaves", "_treedef", "_mask", "_count", "_step", "engine", "origin", "digest")

    def __init__(self, leaves: list[jax.Array], treedef: Any, mask: jax.Array, step: StepInfo,
                 engine: Any, count: jax.Array, origin: "DistributedBatch | None" = None):
        self.origin = origin or self  # the whole batch that parts unpacked from it share
        #: this worker's part of the batch's `rows_digest` (a callable: computed only when asked)
        self.digest: Any = None
        self._leaves = leaves
        self._treedef = treedef
        self._mask = mask
        self._step = step
        self.engine = engine
        self._count = count

    @property
    def data(self) -> Any:
        """The padded global batch, in the structure the dataset yielded."""
        return jax.tree.unflatten(self._treedef, self._leaves)

    @property
    def mask(self) -> jax.Array:
        """Per-sample mask of the padded global batch: 1.0 for real rows, 0.0 for padding."""
        return self._mask

    @property
    def count(self) -> jax.Array:
        """The real number of samples, a replicated float32 scalar."""
        return self._count

    @property
    def step(self) -> StepInfo:
        """The batch's layout: real rows per replica."""
        return self._step

    @property
    def signature(self) -> tuple[Any, ...]:
        """What a compiled step taking the batch depends on: its structure, shapes and dtypes."""
        return (self._treedef, tuple((x.shape, x.dtype) for x in self._leaves), self._mask.shape)

    @property
    def num_real(self) -> int:
        """Number of real (not padding) samples in this global batch."""
        return self._step.num_real

    def __len__(self) -> int:
        data = self.data
        if not isinstance(data, (tuple, list)):
            raise TypeError(f"a DistributedBatch of a {type(data).__name__} has no parts to count or unpack.")
        return len(data)

    def __getitem__(self, i: int) -> "DistributedBatch":
        """Part `i` of a batch that is a tuple or list (``features, labels = batch``, as TF users
        unpack a distributed batch): the same rows, mask and step; several parts of one batch may
        go into one `run` together."""
        part = self.data[i] if isinstance(self.data, (tuple, list)) else None
        if part is None:
            raise TypeError(f"a DistributedBatch of a {type(self.data).__name__} cannot be indexed or unpacked.")
        leaves, treedef = jax.tree.flatten(part)
        return DistributedBatch(leaves, treedef, self._mask, self._step, self.engine, self._count, self.origin)

    def __iter__(self) -> Iterator["DistributedBatch"]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return (f"DistributedBatch(num_real={self.num_real}, padded={self._step.padded_size}, "
                f"replicas={self._step.num_replicas})")


#: what to do when a distributed batch meets a JAX transformation, as when TF's `@tf.function` around a
#: step that calls `strategy.run` is ported as `@jax.jit`
NOT_A_PYTREE = (
    "a distributed batch is not a pytree of arrays, so `jax.jit` (or `jax.tree.map`, ...) cannot take it: pass it to "
    "`strategy.run`. Ported from TF's `@tf.function` around a step that calls `strategy.run`? Drop the `@jax.jit` "
    "decorator: `strategy.run` compiles the step itself, once, and runs it on every replica (a `jax.jit` inside the "
    "function given to `run` is fine).")


def _refuse_flatten(batch: DistributedBatch) -> Any:
    from .._errors import UsageError

    raise UsageError(NOT_A_PYTREE)


# a pytree node whose flattening is refused, so that `jax.jit(step)(batch)` names what to do (JAX
# no longer asks an unknown argument type for an array); lockstep's own tree functions treat it as
# a leaf (`is_leaf`)
jax.tree_util.register_pytree_node(DistributedBatch, _refuse_flatten, lambda aux, children: None)


class BatchDistributor:
    """Places batches on a mesh, split over its `batch_axis` (the mesh's other axes hold copies):
    each worker keeps only its replicas' rows.

    A replica is one index along `batch_axis`, the devices at that index (one on a 1-D mesh); a
    worker holds a replica when it holds one of its devices. A worker's replicas must be
    contiguous along the axis, as `jax.distributed`'s device order makes them. A tuple of axes
    numbers the replicas along them together, the first axis major (as `PartitionSpec` splits).
    """

    def __init__(self, mesh: Mesh, batch_axis: str | tuple[str, ...], engine: Any = None):
        self._engine = engine  # what the batches it makes say holds them
        self.replicated = NamedSharding(mesh, P())
        self.split = NamedSharding(mesh, P(batch_axis))
        self.devices = list(mesh.devices.flat)
        axes = axis_names(batch_axis)
        at = [mesh.axis_names.index(a) for a in axes]
        by_replica = np.moveaxis(mesh.devices, at, list(range(len(at))))
        owners = []  # the worker holding each replica
        for replica in by_replica.reshape(math.prod(by_replica.shape[:len(at)]), -1):
            workers = {d.process_index for d in replica}
            if len(workers) > 1:
                raise ValueError(f"`mesh` {dict(mesh.shape)} puts devices of workers {sorted(workers)} at one index of "
                                 f"its batch axis {batch_axis!r}: each worker must hold whole replicas.")
            owners.append(workers.pop())
        self.num_replicas = len(owners)
        me = jax.process_index()
        self.local_replica_ids = [i for i, w in enumerate(owners) if w == me]
        ids = self.local_replica_ids
        if not ids or ids != list(range(ids[0], ids[-1] + 1)):
            raise ValueError(f"worker {me} holds the replicas {ids} along `mesh` axis {batch_axis!r}: every worker "
                             "must hold at least one replica, its replicas contiguous.")
        per_process = collections.Counter(owners)
        self.replicas_per_process = [per_process[p] for p in range(jax.process_count())]
        self._counts: dict[int, jax.Array] = {}
        self._layouts: dict[Any, tuple[jax.Array, StepInfo, jax.Array]] = {}
        #: `(what, values)` -> None, raising where the workers' values differ (several workers)
        self.agree_on_values: Callable[[str, dict[str, Any]], None] | None = None

    def put_replicated(self, x: Any) -> Any:
        """`x` (a pytree) copied to every device."""
        return jax.device_put(x, self.replicated)

    def put_copies(self, x: Any) -> Any:
        """`x` (a pytree of NumPy arrays, the same on every worker) copied to every device, without
        the check across workers that `put_replicated` makes in a multi-worker job (a collective:
        `jax.device_put` compares the whole value): for values the workers already agree on."""
        if jax.process_count() == 1:
            return jax.device_put(x, self.replicated)
        return jax.tree.map(lambda a: jax.make_array_from_callback(np.shape(a), self.replicated,
                                                                   lambda index: np.asarray(a)[index]), x)

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

    def place_taken(self, leaves: list[np.ndarray], rows: np.ndarray, global_rows: int) -> list[jax.Array]:
        """`place_split([np.take(x, rows, axis=0) for x in leaves], global_rows)` (`rows`: this
        process's rows, in replica order), each replica's block gathered straight into a buffer
        that its devices take as they are (on the CPU, without copying it again)."""
        first = self.local_replica_ids[0] * (global_rows // self.num_replicas)
        placed = []
        for x in leaves:
            shape = (global_rows, *x.shape[1:])
            blocks: dict[tuple[int, int], np.ndarray] = {}
            arrays = []
            for device, index in self.split.addressable_devices_indices_map(shape).items():
                lo, hi, _ = index[0].indices(global_rows)
                if (lo, hi) not in blocks:
                    blocks[lo, hi] = aligned_take(x, rows[lo - first:hi - first])
                arrays.append(jax.device_put(blocks[lo, hi], device, may_alias=True))
            placed.append(jax.make_array_from_single_device_arrays(shape, self.split, arrays))
        return placed

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
        dist = DistributedBatch(self.place_split(rows, r * b), treedef, layout[0], layout[1], self._engine,
                                layout[2])
        dist.digest = lambda: rows_digest([x[:real] for x in rows], lo)
        return dist

    def distribute(self, source: Iterable[Any], per_worker: bool = False, padded_size: int | None = None
                   ) -> Iterator[DistributedBatch]:
        """A pass of host batches placed on the mesh: global batches (arrays or `BatchRows`, the
        same on every worker, padded to `padded_size` rows at least; prepared ahead on
        accelerators), or with `per_worker` each worker's own batches."""
        if per_worker:
            return self.local_batches(source)
        batches = self._global_batches(source, padded_size)
        depth = prefetch_depth(self.devices)
        if jax.process_count() == 1 and depth > 0:
            batches = prefetch(batches, depth)
        return batches

    def _global_batches(self, source: Iterable[Any], padded: int | None) -> Iterator[DistributedBatch]:
        """Each worker reads the whole global batches and keeps its rows: with several workers the
        first batch is compared at once, the others by their checksums at the pass's end (one
        exchange a pass), so batches that differ after the first are named, not mixed."""
        checksums: dict[str, int] = {}  # one CRC per run of 256 batches: the exchange stays small
        for i, batch in enumerate(source):
            if jax.process_count() > 1 and not isinstance(batch, BatchRows):
                if i == 0:
                    check_same_first_batch(batch)
                else:
                    start = (i - 1) // 256 * 256 + 2
                    key = f"the checksum of batches {start}-{start + 255}"
                    checksums[key] = batch_checksum(jax.tree.leaves(batch), checksums.get(key, 0))
            dist = self.global_batch(batch, padded)
            if padded is None:
                padded = dist.step.padded_size
            yield dist
        if checksums and self.agree_on_values is not None:
            self.agree_on_values("the batches of a pass (checksums; an iterable of global batches must give the same "
                                 "batches on every worker)", checksums)

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
            dist = DistributedBatch(placed[:-1], treedef, placed[-1], step, self._engine, self._count(step.num_real))
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


def check_same_first_batch(batch: Any) -> None:
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
