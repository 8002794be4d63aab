"""Input pipelines: global batches from arrays; distribution happens in the strategy."""

from ._accumulation import AccumulationGroup as AccumulationGroup
from ._accumulation import accumulation_groups as accumulation_groups
from ._batches import Batches as Batches
from ._batches import batches as batches
from ._indexed import IndexedBatches as IndexedBatches
from ._tf_batches import TFDatasetBatches as TFDatasetBatches
from ._worker_pipeline import WorkerPipeline as WorkerPipeline

__all__ = ["AccumulationGroup", "Batches", "IndexedBatches", "TFDatasetBatches", "WorkerPipeline", "accumulation_groups", "batches"]
