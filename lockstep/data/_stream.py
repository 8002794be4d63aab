"""`DataStream`: `fit`'s training data as one stream of batches over the epochs, and its position.

Without `steps_per_epoch` an epoch is one pass over the data. With it, the stream goes on across
epochs as Keras' does (epoch 2 continues where epoch 1 stopped); when a pass ends inside an
epoch, that epoch ends there, as Keras 3's do, and the next starts a new pass (arrays and Grain
`MapDataset`s reshuffled from the seed and the pass number, other re-iterables started again);
a one-shot iterator that runs out before the promised steps is an error, not a short epoch.

The position (`DataPosition`: pass, batches consumed, a checksum of the last batch consumed and
the Grain iterator states) goes into every backup. A resume starts the pass at that batch: by
index for arrays and `MapDataset`s, by setting each worker's iterator state for a Grain
`IterDataset` / `DataLoader`, else by reading the consumed batches again. Where it reads, the last
batch consumed is read again first and its checksum compared, so a source that does not give the
same data again (an unseeded shuffle, changed files) is an error, not a silent skip or repeat.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ._adapter import DataAdapter
from ..engine import DIGEST_MODULUS, allgather_sizes

if TYPE_CHECKING:
    from ..engine import DistributedBatch, Engine, ResidentBatch


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where `fit` is in its training data.

    Attributes:
      pass_index: the pass over the data in progress (a pass's shuffle derives from seed and pass).
      offset: batches of that pass consumed.
      fingerprint: checksum of the last batch consumed (every worker's rows), or None.
      iterators: each worker's Grain iterator state (JSON), in worker order, or None.
      order: where the global random state (NumPy's for arrays, Python's for a `PyDataset`'s
        batches) stood before the pass was drawn and stands now, for data shuffled from it as
        Keras does (`fit(seed=None)`; JSON), or None.

    >>> DataPosition(2, 5).to_json()
    {'pass_index': 2, 'offset': 5, 'fingerprint': None, 'iterators': None, 'order': None}
    """

    pass_index: int = 0
    offset: int = 0
    fingerprint: int | None = None
    iterators: tuple[str, ...] | None = None
    order: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"pass_index": self.pass_index, "offset": self.offset, "fingerprint": self.fingerprint,
                "iterators": None if self.iterators is None else list(self.iterators), "order": self.order}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DataPosition":
        its = d.get("iterators")
        fp = d.get("fingerprint")
        return cls(int(d["pass_index"]), int(d["offset"]), None if fp is None else int(fp),
                   None if its is None else tuple(its), d.get("order"))


def _whole_digest(batch: "DistributedBatch | ResidentBatch") -> int:
    """The checksum of a distributed batch: every worker's part added up (a small collective)."""
    part = batch.digest() if batch.digest is not None else 0
    return int(allgather_sizes(part).sum()) % DIGEST_MODULUS


def _allgather_strings(s: str) -> list[str]:
    """Every worker's `s`, in worker order (two small collectives)."""
    if jax.process_count() == 1:
        return [s]
    data = np.frombuffer(s.encode(), np.uint8)
    lengths = allgather_sizes(len(data))
    from jax.experimental import multihost_utils

    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(data)] = data
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [bytes(row[:n]).decode() for row, n in zip(every, lengths)]


class DataStream:
    """The training batches of a `fit`, epoch by epoch, and the position in them."""

    def __init__(self, engine: "Engine", train: DataAdapter, steps_per_epoch: int | None, k: int,
                 first_pass: int = 0, resident: bool = True, epochs: int | None = None):
        self._engine = engine
        # the last pass `fit` will read, when an epoch is a pass: no pass after it is placed ahead
        self._last_pass = None if steps_per_epoch is not None or epochs is None else epochs - 1
        self._resident = resident  # in-memory data that fits stays on the devices (`ResidentBatch`es)
        self._train = train
        train.new_fit()
        self._steps = steps_per_epoch
        self._k = k
        self._per_epoch = None if steps_per_epoch is None else steps_per_epoch * k
        self._pass, self._offset = first_pass, 0
        self._batches: Iterator[Any] | None = None  # the pass in progress
        self._last: DistributedBatch | ResidentBatch | None = None
        self._restored: DataPosition | None = None  # taken up when the pass is opened
        self._carried: DataPosition | None = None  # the restored position, until a batch is consumed
        self._ended = False  # an epoch-long pass ran out: it stays the position until the next epoch
        self._warned = False
        self.samples = 0  # real rows given to training (`Goodput`)
        self.input_seconds = 0.0  # time spent waiting for the next batch

    def start(self, position: DataPosition) -> None:
        """Continue from `position` (a restored backup's)."""
        self._pass, self._offset = position.pass_index, position.offset
        self._batches, self._last, self._ended = None, None, False
        self._restored = self._carried = position
        if position.order is not None:  # arrays shuffled from NumPy's global state: drawn again as they were
            self._train.restore_order(position.pass_index, position.order)

    def position(self, share: bool = False) -> DataPosition:
        """The position now. With several workers, the checksum and the iterator states are every
        worker's only with `share=True`, a collective that every worker must call at the same step."""
        order = self._train.order_state(self._pass)
        if self._offset == 0:
            return DataPosition(self._pass, 0, order=order)
        if self._last is None and self._carried is not None:
            return dataclasses.replace(self._carried, order=order)
        if jax.process_count() > 1 and not share:
            return DataPosition(self._pass, self._offset, order=order)
        state = self._train.iterator_state()
        return DataPosition(self._pass, self._offset, None if self._last is None else _whole_digest(self._last),
                            None if state is None else tuple(_allgather_strings(state)), order)

    def epoch(self, epoch: int, done: int = 0) -> Iterator["DistributedBatch | ResidentBatch"]:
        """Epoch `epoch`'s batches: the rest of a pass, or of `steps_per_epoch` steps (`done` steps
        of it taken before a resume; as in Keras, fewer where a pass of re-readable data ends). In-memory data that fits on the devices comes as
        `ResidentBatch`es (its rows gathered by the step), other data as placed batches. The data
        is told where the epoch begins (`ended`: where it ends)."""
        self._train.loop_begins()
        yield from self._epoch(epoch, done)

    def ended(self) -> None:
        """The epoch's batches were all trained (no callback stopped it): the data is told, after
        the last call's batch hooks, as Keras tells a `PyDataset`."""
        self._train.loop_ended()

    def _epoch(self, epoch: int, done: int) -> Iterator["DistributedBatch | ResidentBatch"]:
        if self._per_epoch is None and self._batches is None and (self._offset == 0 or self._ended or not done):
            # an epoch is a pass: its order derives from (seed, epoch); a resume at an epoch's start
            # (from a backup at the previous epoch's end) starts its pass afresh too
            self._pass, self._offset, self._ended = epoch, 0, False
        elif self._ended:  # the last epoch ended with its pass: this one starts the next
            self._pass, self._offset, self._ended = self._pass + 1, 0, False
        given = done * self._k
        while self._per_epoch is None or given < self._per_epoch:
            if self._batches is None:
                self._batches = self._open()
            waited = time.perf_counter()
            batch = next(self._batches, None)
            self.input_seconds += time.perf_counter() - waited
            if batch is None:  # the pass ended
                self._batches = None
                if self._per_epoch is None:  # an epoch is a pass; a backup taken before the epoch's end
                    if given == 0:           # (a short accumulation group reads past its last batch)
                        self._ran_out(epoch, given)  # must still place it in this pass
                    self._ended = True
                    return
                if self._offset == 0:  # a new pass gave nothing
                    self._ran_out(epoch, given)
                if given and not getattr(self._train, "one_shot", False):  # (a generator: `_ran_out` next)
                    self._ended_early(epoch, given)  # as Keras: the epoch ends with its pass; the position
                    self._ended = True               # stays at the pass's end (a backup here resumes
                    return                           # into this epoch's end), the next epoch starts anew
                self._pass, self._offset = self._pass + 1, 0
                continue
            self._train.taken(self._pass, self._offset)
            self._offset += 1
            given += 1
            self._last, self._carried = batch, None
            self.samples += batch.num_real
            yield batch

    def close(self) -> None:
        """The end of `fit`: a pass the data placed ahead that no epoch took is let go (its devices'
        memory; its arrays read again by the next `fit`)."""
        self._batches = None
        self._train.release()

    def _ended_early(self, epoch: int, given: int) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"a pass over the training data ended after {given // self._k} of `steps_per_epoch={self._steps}` "
                f"steps in epoch {epoch + 1}: the epoch ends there and the next starts a new pass, as in Keras "
                "('Your input ran out of data'). Use a `steps_per_epoch` that divides the batches of a pass to "
                "keep epochs alike.", UserWarning, stacklevel=4)

    def _ran_out(self, epoch: int, given: int) -> None:
        if self._per_epoch is None:
            raise ValueError(
                f"`x` yielded no batch in epoch {epoch + 1}: a one-shot iterator is used up after one pass; "
                "pass a re-iterable (a list, lockstep.data.batches, a tf.data dataset) or `steps_per_epoch`.")
        raise ValueError(
            f"the training data ran out after {given // self._k} of `steps_per_epoch={self._steps}` steps in epoch "
            f"{epoch + 1}: a one-shot iterator (a generator) is used up. Give `fit` at least steps_per_epoch x "
            "epochs batches (an endless generator), or a re-iterable (a list, lockstep.data.batches, a Grain or "
            "tf.data dataset), which the stream starts again when a pass ends.")

    def _open(self) -> Iterator[Any]:
        """The pass in progress from the current offset (after a resume: checked first)."""
        restored, self._restored = self._restored, None
        train, p, o = self._train, self._pass, self._offset
        check = int(restored is not None and restored.fingerprint is not None and o > 0)
        state = self._my_iterator_state(restored) if restored is not None and o > 0 else None
        if state is not None:  # a pipeline set to its saved position: nothing to read again
            return train.distributed(self._engine, p, o, state, fixed_padding=True)
        ahead = self._last_pass is None or p < self._last_pass
        batches = train.resident_pass(self._engine, p, o - check, ahead) if self._resident else None
        if batches is None:
            batches = train.distributed(self._engine, p, o - check, fixed_padding=True)
        if check:
            assert restored is not None
            self._check(next(batches, None), restored)
        return batches

    def _my_iterator_state(self, restored: DataPosition) -> str | None:
        if restored.iterators is None:
            return None
        if len(restored.iterators) != jax.process_count():
            raise ValueError(
                f"the backup holds the iterator states of {len(restored.iterators)} workers' pipelines and this job "
                f"has {jax.process_count()} workers: a per-worker pipeline (a Grain IterDataset or DataLoader, "
                "sharded by worker) cannot move to another number of workers. Resume on "
                f"{len(restored.iterators)} workers, or give fit a grain.MapDataset (random access: lockstep "
                "shards it, and it resumes on any number of workers).")
        return restored.iterators[jax.process_index()]

    def _check(self, batch: Any, restored: DataPosition) -> None:
        """The last batch consumed before the backup, read again, must be the one trained on."""
        where = f"batch {restored.offset} of pass {restored.pass_index + 1}"
        if batch is None:
            raise ValueError(f"cannot resume: the training data now ends before {where}, the last one trained on "
                             "before the backup. Resume with the same data.")
        if _whole_digest(batch) != restored.fingerprint:
            raise ValueError(
                f"cannot resume: the training data differs from what was trained on before the backup ({where}, "
                "the last one trained on, read again, has another checksum). The source is not deterministic (a "
                "shuffle without a seed, random augmentation outside the model), the data changed, or a per-worker "
                "pipeline is split differently on this number of workers. Seed every random step of the pipeline, "
                "resume with the same data and workers, or delete the backup to start over.")
