"""A batch's rows: how they are padded, which replica holds which rows, and the mask.

Pure host-side functions (NumPy only, no devices), shared by every input path: global batches
(`experimental_distribute_dataset`, `fit` on arrays) and per-worker pipelines
(`distribute_datasets_from_function`). A padded batch repeats its first real row, so padding
stays valid input (labels in range, no log(0)); the mask says which rows are real.

>>> import numpy as np
>>> rows, mask = pad_and_mask([np.arange(5.0)], num_real=5, start=4, stop=8)
>>> rows[0].tolist(), mask.tolist()
([4.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0])
>>> StepInfo.contiguous(num_replicas=4, per_replica=2, num_real=5).counts.tolist()
[2, 2, 1, 0]
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np


class StepInfo:
    """Host-side facts of one distributed batch: which rows of each replica are real.

    Known on the host when the batch is built (on every worker), so trimming padding never
    waits on a device. Replica `r` holds `counts[r]` real rows, then padding.
    """

    __slots__ = ("num_replicas", "per_replica", "num_real", "counts", "row_mask")

    def __init__(self, num_replicas: int, per_replica: int, counts: np.ndarray):
        self.num_replicas = num_replicas
        self.per_replica = per_replica
        self.counts = np.asarray(counts, np.int64)  # (R,)
        self.num_real = int(self.counts.sum())
        self.row_mask = np.arange(per_replica)[None, :] < self.counts[:, None]  # (R, b) bool

    @classmethod
    def contiguous(cls, num_replicas: int, per_replica: int, num_real: int) -> "StepInfo":
        """A global batch of `num_real` rows laid out replica after replica, padding at the end."""
        starts = np.arange(num_replicas) * per_replica
        return cls(num_replicas, per_replica, np.clip(num_real - starts, 0, per_replica))

    @classmethod
    def of_workers(cls, sizes: np.ndarray, replicas_per_worker: list[int], per_replica: int) -> "StepInfo":
        """Per-worker batches of `sizes[w]` real rows, each laid out over that worker's replicas."""
        counts = np.concatenate([np.clip(int(k) - np.arange(r) * per_replica, 0, per_replica)
                                 for k, r in zip(sizes, replicas_per_worker)])
        return cls(len(counts), per_replica, counts)

    @property
    def padded_size(self) -> int:
        """Rows of the padded global batch (all replicas)."""
        return self.num_replicas * self.per_replica


def padded_per_replica(num_real: int, num_replicas: int, padded_size: int | None = None) -> int:
    """Rows per replica for a global batch of `num_real` rows, at least `padded_size` in all."""
    return math.ceil(max(padded_size or 0, num_real) / num_replicas)


def pad_and_mask(leaves: list[np.ndarray], num_real: int, start: int, stop: int
                 ) -> tuple[list[np.ndarray], np.ndarray]:
    """Rows `start:stop` of `leaves` padded past `num_real` (padding repeats row 0), and their mask.

    Returns:
      The rows of every leaf, and a float32 mask (1.0 real, 0.0 padding) of `stop - start` rows.
    """
    if start == 0 and stop <= num_real:
        rows = [x[:stop] for x in leaves]
    else:
        idx = np.arange(start, stop)
        rows = [np.take(x, np.where(idx < num_real, idx, 0), axis=0) for x in leaves]
    return rows, (np.arange(start, stop) < num_real).astype(np.float32)


def aligned_take(x: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """`np.take(x, rows, axis=0)` (None: a copy of `x`) into a buffer aligned to 64 bytes, which
    XLA's CPU devices use in place (`jax.device_put` makes no copy of it).

    >>> a = aligned_take(np.arange(6.0).reshape(3, 2), np.array([2, 0]))
    >>> a.tolist(), a.ctypes.data % 64
    ([[4.0, 5.0], [0.0, 1.0]], 0)
    """
    shape = (len(x) if rows is None else len(rows), *x.shape[1:])
    size = int(np.prod(shape)) * x.dtype.itemsize
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + size].view(x.dtype).reshape(shape)
    if rows is None:
        out[...] = x
    elif len(rows):
        np.take(x, rows, axis=0, out=out, mode="clip")  # "clip": not buffered ("raise" copies through a buffer)
    return out


class BatchRows:
    """A global batch of `num_real` rows that each worker reads only part of: `read(lo, hi)` gives
    rows ``lo:hi`` (the batch's pytree of arrays), `blank()` one row of the same shapes and dtypes
    (padding for a worker that holds none of the batch's real rows)."""

    __slots__ = ("num_real", "read", "blank")

    def __init__(self, num_real: int, read: Any, blank: Any):
        self.num_real = num_real
        self.read = read
        self.blank = blank


#: Row checksums are kept modulo this prime, so every worker's part fits the int32 that a
#: collective (`allgather_sizes`) carries.
_SAMPLED_BYTES = 1 << 20  # a checksum reads at most this many bytes of an array (evenly spread)


def batch_checksum(leaves: list[Any], h: int = 0) -> int:
    """A CRC-32 of a host batch's arrays (shapes, dtypes and contents; of a large array, 1 MiB of
    bytes spread evenly over it), to compare the batches the workers read; `h` goes on from a
    previous checksum.

    >>> x = np.arange(6.0)
    >>> batch_checksum([x]) == batch_checksum([x.copy()]), batch_checksum([x]) == batch_checksum([x + 1])
    (True, False)
    """
    for leaf in leaves:
        a = to_numpy(leaf)
        h = zlib.crc32(f"{a.shape} {a.dtype}".encode(), h)
        if a.dtype == object:
            h = zlib.crc32(repr(a.ravel()[:1024].tolist()).encode(), h)
            continue
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if raw.size > _SAMPLED_BYTES:
            raw = np.ascontiguousarray(raw[:: -(-raw.size // _SAMPLED_BYTES)])
        h = zlib.crc32(raw, h)
    return h


DIGEST_MODULUS = 2**31 - 1


def rows_digest(leaves: list[np.ndarray], start: int) -> int:
    """A checksum of real rows (`leaves`, rows of a global batch from row `start` on), additive over
    workers: the sum of the parts the workers hold, modulo `DIGEST_MODULUS`, is the whole batch's,
    however it is split.

    A worker that holds none of a batch's real rows (a short last batch) contributes 0.

    >>> x = np.arange(6.0).reshape(3, 2)
    >>> rows_digest([x], 0) == (rows_digest([x[:1]], 0) + rows_digest([x[1:]], 1)) % DIGEST_MODULUS
    True
    >>> rows_digest([x[3:]], 3)
    0
    """
    n = int(np.shape(leaves[0])[0]) if leaves else 0
    if n == 0:
        return 0
    flat = [np.ascontiguousarray(x).reshape(n, -1).view(np.uint8) for x in leaves]
    total = 0
    for i in range(n):
        h = start + i
        for f in flat:
            h = zlib.crc32(f[i], h)
        total += h
    return total % DIGEST_MODULUS


def batch_length(leaves: list[np.ndarray]) -> int:
    """The common leading dimension of a batch's arrays.

    Raises:
      ValueError: arrays of different lengths, a scalar, or an empty batch.
    """
    lengths = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(lengths) != 1 or -1 in lengths:
        shapes = [np.shape(x) for x in leaves]
        raise ValueError(f"every array of a batch must have the same leading (batch) dimension, got shapes {shapes}.")
    n = lengths.pop()
    if n < 1:
        raise ValueError("a batch must hold at least one sample, got an empty batch.")
    return n


def to_numpy(x: Any) -> np.ndarray:
    """A batch leaf as a NumPy array (torch tensors are detached and moved to the CPU)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu()
    return np.asarray(x)


def along_rows(weight: Any, ndim: int) -> Any:
    """`weight` (one value per row, or per leading axes such as time steps) with trailing axes of
    size 1 up to `ndim` axes, so it multiplies an array of rank `ndim` row by row: the one
    broadcasting of sample weights and masks (NumPy or JAX arrays).

    >>> along_rows(np.array([1.0, 2.0]), 3).shape
    (2, 1, 1)
    """
    return weight.reshape(weight.shape + (1,) * (ndim - weight.ndim))
