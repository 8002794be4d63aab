"""The engine: compiled replica functions on plain global arrays over a `jax.sharding.Mesh` with
named axes (data parallelism: one ``"batch"`` axis). It never imports the `tf.distribute` face,
training, callbacks or checkpoints; they are built on it.

Modules: `_devices` (simulated CPU devices, backends), `_batch_rows` (a padded batch's rows and mask),
`_cross_replica` (collectives inside a replica, reductions of per-replica arrays outside, host
collectives across workers), `_placement` (batches placed on the mesh), `_replica_context`
(what a replica's function knows), `_loops` (recurrent carries), `_compiler` (the `run`
compiler), `_moments` (cross-replica batch statistics), `_engine` (all of it on one mesh).

Other packages import what they use of it from here, never from its modules.
"""

from ._devices import backends_started as backends_started
from ._batch_rows import along_rows as along_rows
from ._batch_rows import BatchRows as BatchRows
from ._batch_rows import DIGEST_MODULUS as DIGEST_MODULUS
from ._batch_rows import padded_per_replica as padded_per_replica
from ._batch_rows import StepInfo as StepInfo
from ._reduce_op import ReduceOp as ReduceOp
from ._cross_replica import all_gather as all_gather
from ._cross_replica import all_reduce as all_reduce
from ._cross_replica import allgather_ints as allgather_ints
from ._cross_replica import allgather_sizes as allgather_sizes
from ._cross_replica import batch_digests as batch_digests
from ._cross_replica import broadcast_from_chief as broadcast_from_chief
from ._cross_replica import gather_stacked as gather_stacked
from ._cross_replica import held as held
from ._cross_replica import highest as highest
from ._cross_replica import host_value as host_value
from ._cross_replica import own_copies as own_copies
from ._cross_replica import unshared as unshared
from ._cross_replica import lowest as lowest
from ._cross_replica import reduce_replicated as reduce_replicated
from ._cross_replica import reduce_stacked as reduce_stacked
from ._cross_replica import split_rows as split_rows
from ._cross_replica import to_varying as to_varying
from ._cross_replica import spread as spread
from ._replica_context import get_replica_context as get_replica_context
from ._replica_context import replica_context as replica_context
from ._replica_context import replicas_axis as replicas_axis
from ._moments import cross_replica_moments as cross_replica_moments
from ._state_updates import is_recording as is_recording
from ._state_updates import record as record
from ._state_updates import RecordingFunction as RecordingFunction
from ._compiler import note_new_function as note_new_function
from ._placement import DistributedBatch as DistributedBatch
from ._resident import fits_on_devices as fits_on_devices
from ._resident import ResidentBatch as ResidentBatch
from ._resident import ResidentPass as ResidentPass
from ._resident import place_ahead as place_ahead
from ._resident import place_whole as place_whole
from ._resident import take_step as take_step
from ._engine import BATCH_AXIS as BATCH_AXIS
from ._engine import Engine as Engine

__all__ = [
    "all_gather",
    "all_reduce",
    "allgather_ints",
    "allgather_sizes",
    "along_rows",
    "backends_started",
    "BATCH_AXIS",
    "batch_digests",
    "BatchRows",
    "broadcast_from_chief",
    "cross_replica_moments",
    "DIGEST_MODULUS",
    "DistributedBatch",
    "Engine",
    "fits_on_devices",
    "gather_stacked",
    "get_replica_context",
    "held",
    "highest",
    "host_value",
    "own_copies",
    "unshared",
    "is_recording",
    "lowest",
    "note_new_function",
    "padded_per_replica",
    "record",
    "RecordingFunction",
    "reduce_replicated",
    "reduce_stacked",
    "ReduceOp",
    "replica_context",
    "replicas_axis",
    "ResidentBatch",
    "ResidentPass",
    "take_step",
    "place_ahead",
    "place_whole",
    "split_rows",
    "spread",
    "StepInfo",
    "to_varying",
]
