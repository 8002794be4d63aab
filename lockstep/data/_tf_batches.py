"""`TFDatasetBatches`: global batches of a `tf.data.Dataset`, each worker converting only its rows."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ..engine import BatchRows, batch_digests
from ._adapter import DataAdapter


class TFDatasetBatches(DataAdapter):
    """A `tf.data.Dataset` of *global* batches (``dataset.batch(GLOBAL_BATCH_SIZE)``, as for
    `tf.distribute`), split by rows: every worker iterates the same batches, and converts to NumPy
    and sends to its devices only the rows of its own replicas, so each sample counts once
    whatever the number of workers and however the last batch falls (TF's auto-sharding drops or
    repeats samples there). The pipeline itself runs whole on every worker (TF's ``DATA``
    auto-shard policy costs the same); to read only a worker's files, shard them yourself in
    `strategy.distribute_datasets_from_function` (``dataset.shard(ctx.num_input_pipelines,
    ctx.input_pipeline_id)``), or use a Grain `MapDataset`, which lockstep reads by index.

    The workers must see the same batches: a pipeline with an unseeded shuffle would give each
    another order, so at the first batch of every pass the workers compare a checksum of it, and a
    difference is an error. lockstep never imports TensorFlow: it reads the dataset's tensors.
    `fit`, `evaluate`, `predict` and `experimental_distribute_dataset` make this from a
    `tf.data.Dataset`.
    """

    @staticmethod
    def accepts(x: Any) -> bool:
        """Whether `x` is a `tf.data.Dataset` (recognised without importing TensorFlow)."""
        return (type(x).__module__.startswith("tensorflow") and hasattr(x, "element_spec")
                and hasattr(x, "as_numpy_iterator"))

    def __init__(self, dataset: Any):
        scalars = [i for i, spec in enumerate(jax.tree.leaves(dataset.element_spec, is_leaf=lambda s: hasattr(s, "shape")))
                   if getattr(getattr(spec, "shape", None), "rank", None) == 0]
        if scalars:
            raise ValueError(
                f"the tf.data dataset's elements are single samples, not batches (element {scalars[0]} of "
                f"{dataset.element_spec} is a scalar): batch it with the global batch size, "
                "`dataset.batch(GLOBAL_BATCH_SIZE)`, as for Keras and tf.distribute.")
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        """Whole batches as NumPy (every row converted: for a look at the data)."""
        return iter(self.dataset.as_numpy_iterator())

    def __len__(self) -> int:
        """The number of batches, when tf.data knows it (Keras reads `cardinality` the same way)."""
        n = int(self.dataset.cardinality())
        if n < 0:
            raise TypeError("this tf.data dataset's number of batches is unknown or infinite.")
        return n

    host_labels = False  # each worker converts only its rows: the labels are never whole on one host

    def first(self) -> Any:
        return next(iter(self), None)

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterator[BatchRows]:
        """A pass from batch `start`, each batch read by a worker only where it keeps rows."""
        return itertools.islice(self._rows(), start, None)

    def _rows(self) -> Iterator[BatchRows]:
        for i, batch in enumerate(self.dataset):
            leaves, treedef = jax.tree.flatten(batch)
            n = int(leaves[0].shape[0])
            if i == 0 and jax.process_count() > 1:
                _check_same_batch([np.asarray(x) for x in leaves])

            def read(a: int, b: int, leaves: list[Any] = leaves, treedef: Any = treedef) -> Any:
                return jax.tree.unflatten(treedef, [np.asarray(x[a:b]) for x in leaves])
            yield BatchRows(n, read, lambda read=read: read(0, 1))


def _check_same_batch(leaves: list[np.ndarray]) -> None:
    """Every worker's first batch of a pass must be the same (one small collective)."""
    digests, differ = batch_digests(leaves)
    if differ:
        raise ValueError(
            "the workers' tf.data pipelines gave different first batches (checksums "
            f"{digests}, in worker order): each worker splits the same global batches, so every random "
            "step must be seeded the same on every worker (say, dataset.shuffle(buffer, seed=1)), or "
            "samples would be dropped and repeated. For data that differs per worker, use "
            "strategy.distribute_datasets_from_function.")
