"""Atomic saving and loading of weights and training state."""

from ._atomic import atomic_path as atomic_path
from ._atomic import atomic_write as atomic_write
from ._atomic import load_tree as load_tree
from ._atomic import save_tree as save_tree
from ._orbax import TrainingCheckpointer as TrainingCheckpointer
from ._orbax import shardings_of as shardings_of

__all__ = ["TrainingCheckpointer", "shardings_of", "atomic_path", "atomic_write", "load_tree", "save_tree"]
