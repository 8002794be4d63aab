"""lockstep: synchronous data-parallel training on JAX with the `tf.distribute` API.

Every number lockstep reports is the number a single device would report on the whole data.

Submodules load on first use (PEP 562), so ``import lockstep.launch`` (the launcher) does not
import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    "ClusterResolver": "._multi_worker",
    "EnvClusterResolver": "._multi_worker",
    "MultiWorkerMirroredStrategy": "._multi_worker",
    "SlurmClusterResolver": "._multi_worker",
    "TFConfigClusterResolver": "._multi_worker",
    "resolve_cluster": "._multi_worker",
    "DistributedDataset": "._datasets",
    "InputContext": "._datasets",
    "MirroredStrategy": "._strategy",
    "OneDeviceStrategy": "._strategy",
    "Strategy": "._strategy",
    "TPUStrategy": "._strategy",
    "StrategyExtended": "._extended",
    "ValueContext": "._strategy",
    "get_strategy": "._strategy",
    "has_strategy": "._strategy",
    "in_cross_replica_context": "._strategy",
    "Mirrored": "._values",
    "PerReplica": "._values",
    "ReplicaContext": "._values",
    "get_replica_context": "._values",
    "ReduceOp": "._reduce",
    "UsageError": "._errors",
    "WorkersDisagreeError": "._errors",
    "simulate_cpu_devices": "._devices",
    "compute_average_loss": ".losses",
    "cross_replica_moments": "._moments",
    "DataPosition": ".training",
    "FunctionalModel": ".training",
    "TrainState": ".training",
    "Trainer": ".training",
}
_SUBMODULES = ("callbacks", "checkpoint", "data", "launch", "losses", "metrics", "training")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from . import callbacks as callbacks
    from . import checkpoint as checkpoint
    from . import data as data
    from . import launch as launch
    from . import losses as losses
    from . import metrics as metrics
    from . import training as training
    from ._datasets import DistributedDataset as DistributedDataset
    from ._datasets import InputContext as InputContext
    from ._devices import simulate_cpu_devices as simulate_cpu_devices
    from ._errors import UsageError as UsageError
    from ._errors import WorkersDisagreeError as WorkersDisagreeError
    from ._moments import cross_replica_moments as cross_replica_moments
    from ._multi_worker import ClusterResolver as ClusterResolver
    from ._multi_worker import EnvClusterResolver as EnvClusterResolver
    from ._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
    from ._multi_worker import SlurmClusterResolver as SlurmClusterResolver
    from ._multi_worker import TFConfigClusterResolver as TFConfigClusterResolver
    from ._multi_worker import resolve_cluster as resolve_cluster
    from ._reduce import ReduceOp as ReduceOp
    from ._strategy import MirroredStrategy as MirroredStrategy
    from ._strategy import OneDeviceStrategy as OneDeviceStrategy
    from ._strategy import Strategy as Strategy
    from ._strategy import TPUStrategy as TPUStrategy
    from ._extended import StrategyExtended as StrategyExtended
    from ._strategy import ValueContext as ValueContext
    from ._strategy import get_strategy as get_strategy
    from ._strategy import has_strategy as has_strategy
    from ._strategy import in_cross_replica_context as in_cross_replica_context
    from ._values import Mirrored as Mirrored
    from ._values import PerReplica as PerReplica
    from ._values import ReplicaContext as ReplicaContext
    from ._values import get_replica_context as get_replica_context
    from .losses import compute_average_loss as compute_average_loss
    from .training import DataPosition as DataPosition
    from .training import FunctionalModel as FunctionalModel
    from .training import TrainState as TrainState
    from .training import Trainer as Trainer
