"""lockstep: synchronous data-parallel training on JAX with the `tf.distribute` API.

Every number lockstep reports is the number a single device would report on the whole data.

Submodules load on first use (PEP 562), so ``import lockstep.launch`` (the launcher) does not
import JAX.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Keras' models train through lockstep only on Keras' JAX backend: importing lockstep first selects it
# (an explicit KERAS_BACKEND is kept; a Keras on another backend is an error at the first strategy)
if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "jax")

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    "ClusterResolver": ".cluster._resolvers",
    "EnvClusterResolver": ".cluster._resolvers",
    "MultiWorkerMirroredStrategy": ".cluster._multi_worker",
    "SlurmClusterResolver": ".cluster._resolvers",
    "TFConfigClusterResolver": ".cluster._resolvers",
    "resolve_cluster": ".cluster._resolvers",
    "CrossDeviceOps": ".distribute._cross_device_ops",
    "HierarchicalCopyAllReduce": ".distribute._cross_device_ops",
    "NcclAllReduce": ".distribute._cross_device_ops",
    "ReductionToOneDevice": ".distribute._cross_device_ops",
    "DistributedDataset": ".distribute._datasets",
    "InputContext": ".distribute._datasets",
    "MirroredStrategy": ".distribute._strategy",
    "OneDeviceStrategy": ".distribute._strategy",
    "Strategy": ".distribute._strategy",
    "TPUStrategy": ".distribute._tpu",
    "StrategyExtended": ".distribute._extended",
    "DeviceMesh": ".sharding._mesh",
    "LayoutMap": ".sharding._mesh",
    "ShardedStrategy": ".cluster._sharded",
    "memory_estimate": ".keras",
    "ValueContext": ".distribute._strategy",
    "get_strategy": ".distribute._strategy",
    "has_strategy": ".distribute._strategy",
    "in_cross_replica_context": ".distribute._strategy",
    "Mirrored": ".distribute._values",
    "PerReplica": ".distribute._values",
    "ReplicaContext": ".engine._replica_context",
    "get_replica_context": ".engine._replica_context",
    "ReduceOp": ".engine._reduce_op",
    "UsageError": "._errors",
    "WorkersDisagreeError": "._errors",
    "simulate_cpu_devices": ".engine._devices",
    "compute_average_loss": ".losses",
    "scale_regularization_loss": ".losses",
    "cross_replica_moments": ".engine._moments",
    "DataPosition": ".data",
    "FunctionalModel": ".training",
    "TrainState": ".training",
    "Trainer": ".keras",
}
_SUBMODULES = ("callbacks", "checkpoint", "data", "experimental", "keras", "launch", "losses", "metrics", "training")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


#: the parts whose names, when first asked for, make Keras follow lockstep's scopes first
#: (`lockstep.keras.install`: Keras' distribution in a scope, Keras' own `model.fit` run by the
#: Trainer, Keras metrics inside `strategy.run`): every public strategy comes from one of them, so
#: a scope entered before it is one of a strategy made from a private module (`_scope` warns)
_KERAS_FOLLOWS = (".distribute", ".cluster", ".training", ".experimental", ".keras")


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name, f".{name}" if name in _SUBMODULES else None)
    if module is None:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    if module.startswith(_KERAS_FOLLOWS):
        from .keras import install

        install()
    value = importlib.import_module(module, __name__)
    value = getattr(value, name) if name in _EXPORTS else value
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from . import callbacks as callbacks
    from . import checkpoint as checkpoint
    from . import data as data
    from . import experimental as experimental
    from . import launch as launch
    from . import losses as losses
    from . import metrics as metrics
    from . import training as training
    from .distribute._cross_device_ops import CrossDeviceOps as CrossDeviceOps
    from .distribute._cross_device_ops import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
    from .distribute._cross_device_ops import NcclAllReduce as NcclAllReduce
    from .distribute._cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
    from .distribute._datasets import DistributedDataset as DistributedDataset
    from .distribute._datasets import InputContext as InputContext
    from .engine._devices import simulate_cpu_devices as simulate_cpu_devices
    from ._errors import UsageError as UsageError
    from ._errors import WorkersDisagreeError as WorkersDisagreeError
    from .engine._moments import cross_replica_moments as cross_replica_moments
    from .cluster._resolvers import ClusterResolver as ClusterResolver
    from .cluster._resolvers import EnvClusterResolver as EnvClusterResolver
    from .cluster._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
    from .cluster._resolvers import SlurmClusterResolver as SlurmClusterResolver
    from .cluster._resolvers import TFConfigClusterResolver as TFConfigClusterResolver
    from .cluster._resolvers import resolve_cluster as resolve_cluster
    from .engine._reduce_op import ReduceOp as ReduceOp
    from .distribute._strategy import MirroredStrategy as MirroredStrategy
    from .distribute._strategy import OneDeviceStrategy as OneDeviceStrategy
    from .distribute._strategy import Strategy as Strategy
    from .distribute._tpu import TPUStrategy as TPUStrategy
    from .distribute._extended import StrategyExtended as StrategyExtended
    from .sharding._mesh import DeviceMesh as DeviceMesh
    from .sharding._mesh import LayoutMap as LayoutMap
    from .cluster._sharded import ShardedStrategy as ShardedStrategy
    from .distribute._strategy import ValueContext as ValueContext
    from .distribute._strategy import get_strategy as get_strategy
    from .distribute._strategy import has_strategy as has_strategy
    from .distribute._strategy import in_cross_replica_context as in_cross_replica_context
    from .distribute._values import Mirrored as Mirrored
    from .distribute._values import PerReplica as PerReplica
    from .engine._replica_context import ReplicaContext as ReplicaContext
    from .engine._replica_context import get_replica_context as get_replica_context
    from .losses import compute_average_loss as compute_average_loss
    from .losses import scale_regularization_loss as scale_regularization_loss
    from .data import DataPosition as DataPosition
    from .training import FunctionalModel as FunctionalModel
    from .training import TrainState as TrainState
    from .keras import Trainer as Trainer
    from .keras import memory_estimate as memory_estimate
