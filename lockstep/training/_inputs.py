"""What `fit` / `evaluate` / `predict` accept as data, turned into global batches and epochs."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..data import DataAdapter, adapt
from ..data import batches as make_batches
from ..engine import allgather_ints, allgather_sizes

if TYPE_CHECKING:
    from ..distribute import Strategy


def is_arrays(x: Any) -> bool:
    """Whether `x` is an array, a (nested) dict of arrays, or a list of them (a Keras model's
    several inputs or outputs), as opposed to an iterable of batches (a list of ``(x, y)``)."""
    if isinstance(x, (list, tuple)):
        return bool(x) and all(isinstance(v, Mapping | np.ndarray | jax.Array) and is_arrays(v) for v in x)
    return isinstance(x, (np.ndarray, jax.Array)) or (
        isinstance(x, Mapping) and bool(x) and all(is_arrays(v) for v in x.values()))


def _check_numbers(x: Any, arg: str) -> None:
    for leaf in jax.tree.leaves(x):
        if np.asarray(leaf).dtype.kind in "USOa":
            raise TypeError(
                f"`{arg}` holds {np.asarray(leaf).dtype} values, not numbers: encode them first (a vocabulary "
                "lookup or tokenizer outside the model), then pass the numeric arrays.")


def num_samples(x: Any) -> int:
    return int(np.shape(jax.tree.leaves(x)[0])[0])


def to_batches(strategy: "Strategy", x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool | str,
               seed: int | None, arg: str = "x") -> DataAdapter:
    """`x` as a data adapter: arrays (with `y` / `sample_weight`) as global batches, anything else
    as `lockstep.data.adapt` makes it (a distributed dataset must be `strategy`'s). `seed` None:
    arrays and `PyDataset`s shuffled from the global random states as Keras does (`GlobalOrders`),
    Grain datasets from seed 0."""
    if x is None:
        raise ValueError(f"`{arg}` is required, got None.")
    if isinstance(shuffle, str) and shuffle != "batch":  # Keras would take a misspelt "batch" as True
        raise ValueError(f"`shuffle` must be True, False or 'batch' (as in Keras), got shuffle={shuffle!r}.")
    if isinstance(x, (list, tuple)) and y is not None and not is_arrays(x):
        raise TypeError(
            f"`{arg}` is a Python {type(x).__name__} and `y` is given: pass NumPy arrays (`np.asarray({arg})`), "
            f"or pass an iterable of (x, y) batches as `{arg}` without `y`.")
    if not is_arrays(x):  # "batch" (rows permuted inside each batch) is for arrays: other data keeps its order
        data = adapt(x, y, sample_weight, batch_size, bool(shuffle) and shuffle != "batch", seed, arg)
        if not data.belongs_to(strategy.extended):
            raise ValueError(f"`{arg}` is a distributed dataset of another strategy than the trainer's.")
        return data
    _check_numbers(x, arg)
    n = num_samples(x)
    _check_same_length_on_every_worker(n, arg)  # first: a worker with none must not leave the others waiting
    if n == 0:
        raise ValueError(f"`{arg}` holds no samples (length 0): give at least one.")
    arrays: list[Any] = [x]
    for name, a in (("y", y), ("sample_weight", sample_weight)):
        if a is None:
            if name == "y" and sample_weight is not None:
                raise ValueError("`sample_weight` needs `y`.")
            continue
        a = jax.tree.map(np.asarray, a) if isinstance(a, (Mapping, list, tuple)) and is_arrays(a) else np.asarray(a)
        for leaf in jax.tree.leaves(a):  # one array, or one per output of the model
            if leaf.ndim == 0 or leaf.shape[0] != n:
                raise ValueError(f"`{arg}` and `{name}` must have the same number of samples: `{arg}` has {n}, "
                                 f"`{name}` has {leaf.shape[0] if leaf.ndim else 'a scalar'}.")
            if name == "sample_weight":
                _check_sample_weight_shape(leaf, arrays[1] if len(arrays) > 1 and leaf is a else None)
        arrays.append(a)
    given = iter(arrays[1:])
    _check_same_content_on_every_worker({arg: x, **{name: None if a is None else next(given) for name, a in
                                                    (("y", y), ("sample_weight", sample_weight))}}, n, arg)
    return make_batches(tuple(arrays), 32 if batch_size is None else batch_size, shuffle=shuffle, seed=seed)


def _check_same_length_on_every_worker(n: int, arg: str) -> None:
    """Array inputs are the global data, the same on every worker: refuse lengths that differ (each
    worker would run another number of steps, and the collectives would wait for the missing ones)."""
    if jax.process_count() == 1:
        return
    sizes = [int(s) for s in allgather_sizes(n)]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"`{arg}` has a different number of samples on each worker ({sizes}, in worker order): array inputs "
            "are the global data and must be the same on every worker (each keeps its replicas' rows). For "
            "data that differs per worker, use `strategy.distribute_datasets_from_function`.")


def _check_sample_weight_shape(w: np.ndarray, y: Any) -> None:
    """One weight per sample, shape (N,) or (N, 1); or, for temporal data, one per time step: a
    leading part of `y`'s shape (Keras' rule)."""
    if w.ndim == 1 or w.shape[1:] == (1,):
        return
    y_shape = tuple(np.shape(y)) if isinstance(y, np.ndarray) else None
    if y_shape is not None and len(y_shape) >= w.ndim and w.shape == y_shape[:w.ndim]:
        return
    raise ValueError(
        f"`sample_weight` has shape {w.shape}, but it takes one weight per sample, shape ({w.shape[0]},), or for "
        f"temporal data one per time step, a leading part of `y`'s shape {y_shape}.")


def _content_checksum(a: Any) -> int:
    total = 0
    for leaf in jax.tree.leaves(a):
        leaf = np.ascontiguousarray(leaf)
        total = zlib.crc32(leaf.view(np.uint8).reshape(-1) if leaf.size else b"", total)
    return total & 0x7FFFFFFF  # gathered as int32 (JAX without x64); negative stands for "no array"


def _check_same_content_on_every_worker(arrays: dict[str, Any], n: int, arg: str) -> None:
    """Array inputs are the global data, so the same on every worker: a checksum of each (one pass
    over the bytes, one small collective of the same shape on every worker) refuses copies that
    differ, say, each shuffled with its own seed: each worker keeps its replicas' rows, so some
    samples would be dropped and others repeated. Workers that pass different arguments (one
    calls `fit`, another `predict`) are left to the programs' agreement, which names the calls."""
    if jax.process_count() == 1:
        return
    every = allgather_ints([-1 if a is None else _content_checksum(a) for a in arrays.values()])
    if ((every < 0) != (every[0] < 0)).any():
        return
    for j, name in enumerate(arrays):
        differ = [w for w in range(every.shape[0]) if every[w, j] != every[0, j]]
        if differ:
            what = f"`{name}`" if arg in ("x", name) else f"`{name}` of `{arg}`"
            raise ValueError(
                f"{what} holds other values on worker{'s' if len(differ) > 1 else ''} {differ} than on worker 0 "
                f"(the same {n} samples in number; checksums {every[:, j].tolist()}, in worker order): array inputs "
                "are the global data and must be the same on every worker, which keeps its replicas' rows of each "
                "batch (copies that differ drop some samples and repeat others). Copies shuffled on each worker "
                "with its own seed do this: leave the shuffling to fit (`shuffle=True, seed=...`: the same order "
                "everywhere), or give per-worker data through `strategy.distribute_datasets_from_function`.")


def class_weighted(y: Any, sample_weight: Any, class_weight: dict[int, float] | None) -> Any:
    """Each sample's weight from its class, as Keras turns `class_weight` into sample weights
    (labels rounded, one-hot labels by their largest entry, a class not in `class_weight`
    weighing 1); Keras refuses it beside `sample_weight`, and so does lockstep.

    >>> class_weighted(np.array([0, 1, 1, 2]), None, {0: 1.0, 1: 3.0}).tolist()
    [1.0, 3.0, 3.0, 1.0]
    >>> class_weighted(np.array([[0.9], [0.2]]), None, {1: 5.0}).tolist()   # labels 1 and 0
    [5.0, 1.0]
    """
    if class_weight is None:
        return sample_weight
    if sample_weight is not None:
        raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")  # Keras' own words
    if y is None:
        raise ValueError("`class_weight` needs `y` given as an array (lockstep weighs the samples of arrays).")
    if isinstance(y, (dict, list, tuple)):
        raise ValueError("`class_weight` is only supported for Models with a single output.")  # Keras' own words
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = labels.argmax(-1) if labels.shape[-1] != 1 else labels.squeeze(-1)  # one-hot, as Keras reads it
    if labels.ndim > 1:  # Keras fails on these too (a class per sample is what it weighs)
        raise ValueError(f"`class_weight` weighs each sample by its class, but `y` has labels of shape "
                         f"{np.asarray(y).shape[1:]} per sample: give one class per sample, or `sample_weight`.")
    labels = np.round(labels).astype(int)
    return np.asarray([class_weight.get(c, 1.0) for c in labels.tolist()], np.float32)


def split_validation(x: Any, y: Any, sample_weight: Any, validation_split: float, validation_data: Any = None
                     ) -> tuple[Any, Any, Any, Any]:
    """(x, y, sample_weight, validation_data): the last `validation_split` of the arrays held out."""
    if validation_data is not None:
        raise ValueError("pass either `validation_split` or `validation_data`, not both.")
    if not is_arrays(x):
        raise ValueError("`validation_split` needs array inputs, not an iterable of batches.")
    n = num_samples(x)
    split = int(n * (1.0 - validation_split))
    if split < 1 or split >= n:
        raise ValueError(f"`validation_split={validation_split}` leaves no training or no validation "
                         f"sample out of {n}.")

    def cut(a: Any, s: slice) -> Any:
        return None if a is None else jax.tree.map(lambda v: np.asarray(v)[s], a)
    head, tail = slice(0, split), slice(split, None)
    return cut(x, head), cut(y, head), cut(sample_weight, head), (cut(x, tail), cut(y, tail), cut(sample_weight, tail))


def checked_steps(steps: Any, arg: str = "steps") -> int | None:
    """`steps` (a number of batches to read) checked: a positive integer, or None for all."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1):
        raise ValueError(f"`{arg}` must be a positive integer (or None for every batch), got {arg}={steps!r}.")
    return None if steps is None else int(steps)


class Validation:
    """`fit`'s validation data: its global `batches`, read after the epochs `validation_freq`
    names (every k-th, counted from 1, or those listed, as in Keras), `steps` batches at most.

    >>> v = Validation([], validation_freq=2, steps=None)
    >>> [epoch for epoch in range(6) if v.due(epoch)]
    [1, 3, 5]
    """

    def __init__(self, batches: DataAdapter, validation_freq: Any, steps: Any):
        ok_int = isinstance(validation_freq, (int, np.integer)) and not isinstance(validation_freq, bool)
        if not (ok_int and validation_freq >= 1) and not (
                isinstance(validation_freq, (list, tuple)) and all(isinstance(e, int) for e in validation_freq)):
            raise ValueError("`validation_freq` must be a positive integer (validate every that many epochs) or a list "
                             f"of epochs (counted from 1), got validation_freq={validation_freq!r}.")
        self.batches, self._freq = batches, validation_freq
        self.steps = checked_steps(steps, "validation_steps")

    def due(self, epoch: int) -> bool:
        """Whether to validate at the end of `epoch` (counted from 0)."""
        if isinstance(self._freq, (list, tuple)):
            return epoch + 1 in self._freq
        return (epoch + 1) % int(self._freq) == 0


def validation_batches(strategy: "Strategy", validation_data: Any, batch_size: int | None, validation_freq: Any = 1,
                       validation_steps: Any = None) -> Validation | None:
    """`validation_data` (``(x, y)`` / ``(x, y, sample_weight)`` arrays, or batches) as global batches."""
    if validation_data is None:
        return None
    validation_data = _as_arrays(validation_data)
    if isinstance(validation_data, tuple) and is_arrays(validation_data[0]):
        if not 2 <= len(validation_data) <= 3:
            raise ValueError(f"`validation_data` must be (x, y) or (x, y, sample_weight) arrays, or an iterable of "
                             f"batches; got a tuple of {len(validation_data)} arrays.")
        vx, vy, vw = (*validation_data, None)[:3]
        batches = to_batches(strategy, vx, vy, vw, batch_size, False, 0, "validation_data")
    else:
        batches = to_batches(strategy, validation_data, None, None, None, False, 0, "validation_data")
    return Validation(batches, validation_freq, validation_steps)


def validation_labels(validation_data: Any) -> Any:
    """The labels of array `validation_data` ``(x, y[, sample_weight])``, else None."""
    validation_data = _as_arrays(validation_data)
    if isinstance(validation_data, tuple) and 2 <= len(validation_data) <= 3 and is_arrays(validation_data[0]):
        return validation_data[1]
    return None


def _as_arrays(validation_data: Any) -> Any:
    """`validation_data` given as a list ``[x, y]`` / ``[x, y, sample_weight]`` as the tuple (Keras reads
    it so; a list of ``(x, y)`` tuples is of batches), else as given."""
    if (isinstance(validation_data, list) and 2 <= len(validation_data) <= 3
            and not isinstance(validation_data[0], tuple) and is_arrays(validation_data[0])):
        return tuple(validation_data)
    return validation_data


def first_batch(data: DataAdapter) -> Any:
    """The first batch of `data` (no pass used up)."""
    first = data.first()
    if first is None:
        raise ValueError("the data yields no batch.")
    return first
