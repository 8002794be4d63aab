"""The engine: compiled replica functions on plain global arrays over a `jax.sharding.Mesh` with
named axes (data parallelism: one ``"batch"`` axis). It never imports the `tf.distribute` face,
training, callbacks or checkpoints; they are built on it.

Modules: `_devices` (simulated CPU devices, backends), `_layout` (a padded batch's rows and mask),
`_cross_replica` (collectives inside a replica, reductions of per-replica arrays outside, host
collectives across workers), `_placement` (batches placed on the mesh), `_replica_context`
(what a replica's function knows), `_loops` (recurrent carries), `_compiler` (the `run`
compiler), `_moments` (cross-replica batch statistics), `_engine` (all of it on one mesh).
"""

from ._engine import Engine as Engine
from ._replica_context import get_replica_context as get_replica_context

__all__ = ["Engine", "get_replica_context"]
