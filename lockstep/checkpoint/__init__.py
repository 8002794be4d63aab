"""Atomic files and checkpoints: named arrays plus JSON (a `TrainState`'s `to_arrays()`), written
atomically and checked on reading. Nothing here knows what the arrays are."""

from ._atomic import atomic_path as atomic_path
from ._atomic import atomic_write as atomic_write
from ._atomic import load_tree as load_tree
from ._atomic import save_tree as save_tree
from ._orbax import DamagedCheckpointError as DamagedCheckpointError
from ._orbax import TrainingCheckpointer as TrainingCheckpointer
from ._writer import BackgroundWriter as BackgroundWriter

__all__ = ["BackgroundWriter", "DamagedCheckpointError", "TrainingCheckpointer", "atomic_path", "atomic_write", "load_tree", "save_tree"]
