"""Atomic saving and loading of weights and training state."""

from ._atomic import atomic_path as atomic_path
from ._atomic import atomic_write as atomic_write
from ._atomic import load_tree as load_tree
from ._atomic import save_tree as save_tree
from ._orbax import DamagedCheckpointError as DamagedCheckpointError
from ._orbax import TrainingCheckpointer as TrainingCheckpointer
from ._train_state import METRIC_STATE_PREFIX as METRIC_STATE_PREFIX
from ._train_state import flatten_train_state as flatten_train_state
from ._train_state import unflatten_train_state as unflatten_train_state

__all__ = ["METRIC_STATE_PREFIX", "DamagedCheckpointError", "TrainingCheckpointer", "atomic_path", "atomic_write", "flatten_train_state", "load_tree", "save_tree",
           "unflatten_train_state"]
