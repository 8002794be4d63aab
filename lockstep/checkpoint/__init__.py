"""Atomic saving and loading of weights and training state."""

from ._atomic import atomic_path as atomic_path
from ._atomic import atomic_write as atomic_write
from ._atomic import load_tree as load_tree
from ._atomic import save_tree as save_tree

__all__ = ["atomic_path", "atomic_write", "load_tree", "save_tree"]
