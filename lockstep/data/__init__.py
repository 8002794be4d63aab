"""Input pipelines: every accepted input as a `DataAdapter` (`adapt`: the one place that tells the
kinds apart), and `fit`'s stream of them (`DataStream`: each epoch's batches from a position that a
backup holds, `DataPosition`); placing the batches on devices is the engine's."""

from ._accumulation import AccumulationGroup as AccumulationGroup
from ._adapt import adapt as adapt
from ._adapter import DataAdapter as DataAdapter
from ._adapter import IterableBatches as IterableBatches
from ._adapter import Regenerated as Regenerated
from ._adapter import ReplicaBatches as ReplicaBatches
from ._accumulation import accumulation_groups as accumulation_groups
from ._batches import Batches as Batches
from ._batches import batches as batches
from ._indexed import IndexedBatches as IndexedBatches
from ._py_dataset import PyDatasetBatches as PyDatasetBatches
from ._stream import DataPosition as DataPosition
from ._stream import DataStream as DataStream
from ._tf_batches import TFDatasetBatches as TFDatasetBatches
from ._worker_pipeline import WorkerPipeline as WorkerPipeline

__all__ = ["AccumulationGroup", "Batches", "DataAdapter", "DataPosition", "DataStream", "IterableBatches", "Regenerated", "ReplicaBatches", "adapt", "IndexedBatches", "PyDatasetBatches", "TFDatasetBatches", "WorkerPipeline", "accumulation_groups", "batches"]
