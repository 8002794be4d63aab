"""lockstep: synchronous data-parallel training on JAX with the `tf.distribute` API.

Every number lockstep reports is the number a single device would report on the whole data.
"""

from . import callbacks as callbacks
from . import checkpoint as checkpoint
from . import data as data
from . import losses as losses
from . import metrics as metrics
from ._devices import simulate_cpu_devices as simulate_cpu_devices
from ._errors import UsageError as UsageError
from ._multi_worker import ClusterResolver as ClusterResolver
from ._multi_worker import EnvClusterResolver as EnvClusterResolver
from ._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from ._multi_worker import SlurmClusterResolver as SlurmClusterResolver
from ._multi_worker import TFConfigClusterResolver as TFConfigClusterResolver
from ._multi_worker import resolve_cluster as resolve_cluster
from ._reduce import ReduceOp as ReduceOp
from ._strategy import DistributedDataset as DistributedDataset
from ._strategy import InputContext as InputContext
from ._strategy import MirroredStrategy as MirroredStrategy
from ._strategy import OneDeviceStrategy as OneDeviceStrategy
from ._strategy import Strategy as Strategy
from ._strategy import ValueContext as ValueContext
from ._strategy import get_strategy as get_strategy
from ._values import DistributedBatch as DistributedBatch
from ._values import Mirrored as Mirrored
from ._values import PerReplica as PerReplica
from ._values import ReplicaContext as ReplicaContext
from ._values import get_replica_context as get_replica_context
from .losses import compute_average_loss as compute_average_loss
from .training import FunctionalModel as FunctionalModel
from .training import Trainer as Trainer

__version__ = "0.1.0"

__all__ = [
    "ClusterResolver",
    "EnvClusterResolver",
    "MultiWorkerMirroredStrategy",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "resolve_cluster",
    "FunctionalModel",
    "Trainer",
    "callbacks",
    "checkpoint",
    "DistributedBatch",
    "DistributedDataset",
    "InputContext",
    "Mirrored",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "UsageError",
    "ValueContext",
    "compute_average_loss",
    "data",
    "get_replica_context",
    "get_strategy",
    "losses",
    "metrics",
    "simulate_cpu_devices",
]
