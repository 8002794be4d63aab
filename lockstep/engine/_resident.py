"""Resident rows: in-memory arrays whose pass is placed on the devices at its start, each replica's
rows on its devices once (its share of the batch axis), from which compiled steps take each step's
rows themselves, so that a training step costs the host no copy and no transfer.

A pass (`ResidentPass`) is each replica's rows of every batch, in step order (a replica's rows of
batch `i` are its slice of the batch padded as `_batch_rows` pads a global batch), split over the
batch axis, and each batch's real count. Step `i` of the pass reads its rows inside the compiled
program (`take_step`): each replica slices its block of step `i` and builds its mask from the real
count, which gives exactly the rows, padding and mask that placing the batch from the host gives
(`BatchDistributor.global_batch`). A device holds its replica's share of the pass, not the data
(but with one replica, below).
Each replica's block is gathered on the host straight into a buffer its devices use as is (on the
CPU, no second copy), and `fit` places the next pass in the background (`place_ahead`) while the
current one trains. Where one replica takes every row, its share is the data itself: the arrays are
placed once (`place_whole`) and a pass is the order of its rows on the devices (`table`), which each
step gathers from, so that no pass is gathered on the host.

>>> import jax, numpy as np
>>> from lockstep.engine import Engine
>>> engine = Engine(jax.devices()[:2])
>>> x = np.arange(5.0) * 10
>>> batches = [np.array([4, 0, 2]), np.array([1, 3])]
>>> read = lambda i: BatchRows(len(batches[i]), lambda a, b: x[batches[i][a:b]], lambda: x[:1])
>>> one_pass = ResidentPass(engine.distributor, [x], jax.tree.structure(0), batches, padded=4, rows_of=read)
>>> [np.asarray(s.data).tolist() for s in one_pass.leaves[0].addressable_shards]  # each replica's rows, step by step
[[40.0, 0.0, 10.0, 30.0], [20.0, 40.0, 10.0, 10.0]]
>>> np.asarray(one_pass.counts).tolist()
[3.0, 2.0]
>>> one_pass.batch(1).step.counts.tolist()   # real rows per replica
[2, 0]
>>> np.asarray(one_pass.batch(1).placed().data).tolist()   # the same rows, placed from the host
[10.0, 30.0, 10.0, 10.0]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._batch_rows import BatchRows, StepInfo, aligned_take, rows_digest, to_numpy

#: Largest in-memory training data (all arrays together, in MiB) that `fit` places a pass of at
#: once (each device its replica's share); larger data is placed batch by batch. 0 turns it off.
RESIDENT_LIMIT_MB = float(os.environ.get("LOCKSTEP_RESIDENT_DATA_MB", "256"))


_PLACER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-next-pass")


def place_ahead(make: Callable[[], "ResidentPass"]) -> "Future[ResidentPass]":
    """`make()` run on a background thread: the next pass is gathered on the host and placed on the
    devices while the current one trains (as a pipeline's prefetch; it holds no lock and runs no
    collective, so it never waits on the step). Its error, if any, is raised by `result()`."""
    return _PLACER.submit(make)


def place_whole(distributor: Any, leaves: Sequence[np.ndarray]) -> tuple[jax.Array, ...] | None:
    """A copy of the arrays placed once, whole, where one replica (of one process) takes every
    row, for its passes to index (`ResidentPass`'s `whole`); None with several replicas, whose
    passes are gathered on the host, each replica's rows on its devices (or rows past an int32
    index). A copy: the CPU's devices would otherwise read the caller's arrays, and a change made
    to them during `fit` would reach one replica's steps and not several replicas'."""
    n = int(np.shape(leaves[0])[0])
    if distributor.num_replicas != 1 or jax.process_count() != 1 or n >= 2**31:
        return None
    return tuple(distributor.place_split([aligned_take(np.asarray(x), None) for x in leaves], n))


def fits_on_devices(leaves: Sequence[Any]) -> bool:
    """Whether a pass over arrays of these sizes is placed at once (see `RESIDENT_LIMIT_MB`)."""
    return sum(np.asarray(x).nbytes for x in leaves) <= RESIDENT_LIMIT_MB * 2**20


class ResidentPass:
    """One pass's batches over in-memory `leaves` (of a pytree of structure `treedef`): the sample
    indices of batch `i` are `indices[i]`, padded to `padded` rows (padding repeats the batch's
    first sample, as `_layout.pad_and_mask` does); each replica's rows of every batch are placed
    on its devices (`leaves`, split over the batch axis: this worker reads only its replicas'
    rows); `rows_of(i)` reads batch `i` on the host (for its checksum, or to place it as a whole).
    `whole`: the arrays as `place_whole` placed them, which the pass then indexes (its `table`, the
    rows of every step in order) instead of holding its rows."""

    def __init__(self, distributor: Any, leaves: Sequence[np.ndarray], treedef: Any, indices: Sequence[np.ndarray],
                 padded: int, rows_of: Callable[[int], BatchRows], whole: Sequence[jax.Array] | None = None):
        r = distributor.num_replicas
        if padded % r:
            raise ValueError(f"a resident pass needs `padded` divisible by the {r} replicas, got padded={padded}.")
        self.treedef = treedef
        self.per_replica = padded // r
        self.padded = padded
        self._distributor = distributor
        self._rows_of = rows_of
        ids = distributor.local_replica_ids
        self._lo, self._hi = ids[0] * self.per_replica, (ids[-1] + 1) * self.per_replica
        table = np.empty((len(indices), padded), np.int64)
        counts = np.empty(len(indices), np.float32)
        for i, idx in enumerate(indices):
            table[i] = idx[0]
            table[i, :len(idx)] = idx
            counts[i] = len(idx)
        # replica-major: replica j's rows of batch 0, batch 1, ...; this worker's replicas only
        mine = table.reshape(len(indices), r, self.per_replica)[:, ids[0]:ids[-1] + 1].transpose(1, 0, 2).reshape(-1)
        if whole is None:
            self.leaves = tuple(distributor.place_taken([np.asarray(x) for x in leaves], mine, table.size))
            self.table = None
        else:
            self.leaves, self.table = tuple(whole), distributor.put_copies(mine.astype(np.int32))
        self.counts = distributor.put_copies(counts)
        self._num_real = counts.astype(np.int64)
        self._steps: dict[int, StepInfo] = {}

    def __len__(self) -> int:
        return len(self._num_real)

    def batch(self, i: int) -> "ResidentBatch":
        """Batch `i` of the pass."""
        n = int(self._num_real[i])
        step = self._steps.get(n)
        if step is None:  # full batches share one layout
            step = self._steps[n] = StepInfo.contiguous(self._distributor.num_replicas, self.per_replica, n)
        return ResidentBatch(self, i, step)

    def digest(self, i: int) -> int:
        """This worker's part of batch `i`'s checksum (`_layout.rows_digest` of its real rows), as
        placing the batch gives it."""
        lo, hi = self._lo, max(min(self._hi, int(self._num_real[i])), self._lo)
        if hi == lo:
            return 0
        return rows_digest([to_numpy(x) for x in jax.tree.leaves(self._rows_of(i).read(lo, hi))], lo)

    def placed(self, i: int) -> Any:
        """Batch `i` placed from the host as a `DistributedBatch` (what the pass holds, elsewhere)."""
        return self._distributor.global_batch(self._rows_of(i), self.padded)


class ResidentBatch:
    """Batch `index` of a `ResidentPass`: its rows stay on the devices until a step takes them
    (`take_step`). It has a `DistributedBatch`'s layout (`step`, `num_real`) and checksum (`digest`);
    `placed()` makes the `DistributedBatch` itself, for steps that take arrays.
    """

    __slots__ = ("pass_", "index", "step")

    def __init__(self, pass_: ResidentPass, index: int, step: StepInfo):
        self.pass_ = pass_
        self.index = index
        self.step = step

    @property
    def num_real(self) -> int:
        return self.step.num_real

    def digest(self) -> int:
        return self.pass_.digest(self.index)

    def placed(self) -> Any:
        return self.pass_.placed(self.index)


def take_step(treedef: Any, leaves: Sequence[jax.Array], counts: jax.Array, table: jax.Array | None, i: jax.Array,
              per_replica: int, axis_name: str | tuple[str, ...]) -> tuple[Any, jax.Array, jax.Array]:
    """Inside a replica: its rows of batch `i` of a pass (its block of the pass's `leaves`, or the
    rows `table` names of them; the real counts `counts`) in the data's structure (`treedef`), its
    mask (1.0 real, 0.0 padding) and the batch's real count."""
    r = jax.lax.axis_index(axis_name)
    count = jax.lax.dynamic_index_in_dim(counts, i, keepdims=False)
    mask = (r * per_replica + jnp.arange(per_replica) < count).astype(jnp.float32)
    if table is None:
        rows = [jax.lax.dynamic_slice_in_dim(x, i * per_replica, per_replica) for x in leaves]
    else:
        taken = jax.lax.dynamic_slice_in_dim(table, i * per_replica, per_replica)
        rows = [x[taken] for x in leaves]
    return jax.tree.unflatten(treedef, rows), mask, count
