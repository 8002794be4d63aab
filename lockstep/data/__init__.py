"""Input pipelines: global batches from arrays; distribution happens in the strategy."""

from ._batches import Batches as Batches
from ._batches import batches as batches

__all__ = ["Batches", "batches"]
