"""`adapt`: the one place that asks what kind of input it was given (a Grain `MapDataset`, a
`tf.data.Dataset`, a Grain `IterDataset` / `DataLoader`, lockstep's own batches, a distributed
dataset, a generator function or any iterable of batches); everything after it asks the
`DataAdapter` it returns.

>>> import numpy as np
>>> type(adapt([(np.zeros((2, 3)), np.zeros(2))])).__name__
'IterableBatches'
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from ._adapter import DataAdapter, IterableBatches, Regenerated
from ._indexed import IndexedBatches
from ._py_dataset import PyDatasetBatches
from ._tf_batches import TFDatasetBatches
from ._worker_pipeline import WorkerPipeline


def adapt(x: Any, y: Any = None, sample_weight: Any = None, batch_size: int | None = None, shuffle: bool = False,
          seed: int | None = 0, arg: str = "x", global_batches: bool = False) -> DataAdapter:
    """`x` (anything but arrays, which `lockstep.data.batches` takes) as a `DataAdapter`.

    `global_batches`: `x` must be an iterable of global batches (`experimental_distribute_dataset`):
    Grain's datasets of samples and per-worker pipelines are refused, naming the call that takes each.
    """
    labels_given = y is not None or sample_weight is not None
    if isinstance(x, DataAdapter):  # lockstep's own batches, or a distributed dataset
        if labels_given:
            raise ValueError(f"when `{arg}` is a {type(x).__name__}, `y` and `sample_weight` must be None.")
        return x
    if IndexedBatches.accepts(x):  # a grain.MapDataset (or data source) of samples: read per worker, by index
        if global_batches:
            raise TypeError(
                f"`{arg}` is a {type(x).__name__} of samples (random access): wrap it as "
                "ls.data.IndexedBatches(dataset, batch_size) for global batches that each worker reads only its rows "
                "of, or pass it to fit / evaluate / predict with batch_size.")
        if labels_given:
            raise ValueError(f"when `{arg}` is a {type(x).__name__} of samples, `y` and `sample_weight` must be None "
                             "(each sample carries them).")
        return IndexedBatches(x, 32 if batch_size is None else batch_size, shuffle=shuffle,
                              seed=0 if seed is None else seed)
    if PyDatasetBatches.accepts(x):  # a keras.utils.PyDataset of global batches, read by index
        if labels_given or batch_size is not None:
            raise ValueError(f"when `{arg}` is a keras.utils.PyDataset, `y`, `sample_weight` and `batch_size` must be "
                             "None (as in Keras: its batches carry them).")
        return PyDatasetBatches(x, shuffle=shuffle, seed=seed)
    if TFDatasetBatches.accepts(x):  # a tf.data.Dataset of global batches: each worker converts its rows
        if labels_given or batch_size is not None:
            raise ValueError(f"when `{arg}` is a tf.data dataset, `y`, `sample_weight` and `batch_size` must be None "
                             "(as in Keras: batch the dataset with the global batch size).")
        return TFDatasetBatches(x)
    if WorkerPipeline.accepts(x):  # a grain.IterDataset / DataLoader: this worker's own batches
        if global_batches:
            raise TypeError(
                f"`{arg}` is a {type(x).__name__}, a per-worker pipeline (sharded by worker, as Grain does): "
                "distribute it with `strategy.distribute_datasets_from_function(lambda ctx: dataset)`, or pass it to "
                "fit / evaluate / predict, which also save its iterator state in backups.")
        if labels_given or batch_size is not None:
            raise ValueError(f"when `{arg}` is a {type(x).__name__} (a per-worker pipeline of batches), `y`, "
                             "`sample_weight` and `batch_size` must be None: its batches carry them.")
        return WorkerPipeline(x)
    if inspect.isgeneratorfunction(x) and not global_batches:
        x = Regenerated(x)
    if isinstance(x, (str, bytes)) or not isinstance(x, Iterable):
        what = "an iterable of batches" if global_batches else "arrays, an iterable of batches or a generator function"
        raise TypeError(f"`{arg}` must be {what}, got {type(x).__name__}.")
    if labels_given:
        raise ValueError(f"when `{arg}` is an iterable of batches, `y` and `sample_weight` must be None "
                         "(each batch carries them).")
    return IterableBatches(x)
