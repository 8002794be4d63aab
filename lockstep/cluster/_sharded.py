"""`ShardedStrategy`: models larger than one device, on a mesh of a batch axis and model axes.

Rows are split along the batch axis as in `MirroredStrategy`; a `LayoutMap` splits variables
along the model axes (tensor parallelism), and a ZeRO stage splits them along the batch axis (1:
optimizer state, 2: gradients too, 3: parameters too, gathered for each step: FSDP). Every number
is still one device's: `Trainer`, `model.fit`, `run` / `reduce` / `gather` are unchanged.

>>> import lockstep as ls
>>> mesh = ls.DeviceMesh((2, 4), ("batch", "model"))
>>> layout = ls.LayoutMap(mesh)
>>> layout[".*dense.*/kernel"] = (None, "model")
>>> strategy = ls.ShardedStrategy(mesh=mesh, layout_map=layout, batch_dim_name="batch", zero_stage=3)
>>> strategy.num_replicas_in_sync
2
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
from jax.sharding import NamedSharding

from .._errors import UsageError
from ..distribute import Strategy
from ..engine import BATCH_AXIS, allgather_sizes
from ..sharding import ShardingConfig, as_layout_map, as_mesh
from ._multi_worker import join


def _same_on_every_worker(text: str) -> bool:
    """Whether every worker holds the same `text` (a checksum of it gathered: a collective)."""
    return len(set(allgather_sizes(zlib.crc32(text.encode()) & 0x7FFFFFFF).tolist())) == 1


class ShardedStrategy(Strategy):
    """Synchronous training of a model laid out over `mesh` (a `DeviceMesh`, Keras' or a
    `jax.sharding.Mesh`): replicas along `batch_dim_name`, variables split by `layout_map` along
    the other axes and by `zero_stage` along the batch axis.

    Args:
      mesh: the devices as a grid of named axes.
      layout_map: rules from variable paths (regular expressions, fully matched) to one mesh
        axis or None per dimension; a `LayoutMap`, Keras' `LayoutMap` or a dict.
      batch_dim_name: the mesh axis along which rows are split (Keras' name).
      replica_dim_name: hybrid sharding (HSDP, FSDP2's replicate x shard mesh): a mesh axis of
        whole copies of the ZeRO-sharded model, typically across nodes, while `batch_dim_name`
        runs within one. Rows are split along both (this one major); ZeRO splits along
        `batch_dim_name` only, and a step reduce-scatters each gradient along it, then sums the
        shards along this axis. None (default): every replica along `batch_dim_name`.
      zero_stage: 0 (none), 1 (optimizer state), 2 (and gradients) or 3 (and parameters: FSDP),
        split along the batch axis.
      min_shard_size: variables with fewer elements stay whole along the batch axis.
      shard_dim: which dimension ZeRO splits: ``"largest"`` (default), ``"first"`` or ``"last"``
        of those the layout leaves whole and the batch axis divides (of those it does not divide
        when it divides none). Uneven splits, a rule's or ZeRO's, are padded, never refused: such
        a variable is stored padded with zeros and every number is still one device's.
      max_replicated_fraction: the largest fraction of trainable bytes allowed to stay replicated
        on every device (beyond it: an error before training, with the layout report).
      cluster_resolver, failure_timeout: the job's workers and how long a silent one is waited
        for, as `MultiWorkerMirroredStrategy` takes them: started by `lockstep launch` (or with
        LOCKSTEP_*, TF_CONFIG or SLURM set), every worker runs the same script and a `DeviceMesh`
        built without `devices` spans every worker's devices; each worker must hold whole
        replicas (the batch axis first, as `jax.devices()` orders them by worker).

    Raises:
      UsageError: an unknown or misused axis in a rule, a mesh larger than the devices, a bad
        stage, a mesh spanning processes that did not join through lockstep.
    """

    def __init__(self, mesh: Any, layout_map: Any = None, batch_dim_name: str = BATCH_AXIS, zero_stage: int = 0,
                 min_shard_size: int = 1024, shard_dim: str = "largest", max_replicated_fraction: float = 0.02,
                 cluster_resolver: Any = None, failure_timeout: float | None = None,
                 replica_dim_name: str | None = None):
        device_mesh = as_mesh(mesh)
        # a mesh whose devices are still to be found spans the job's workers: join them first
        joins = cluster_resolver is not None or not device_mesh.resolved
        self.cluster_resolver, self.failure_timeout, agreement = (join(cluster_resolver, failure_timeout) if joins
                                                              else (None, failure_timeout, None))
        for name, axis in (("replica_dim_name", replica_dim_name), ("batch_dim_name", batch_dim_name)):
            if axis is not None and axis not in device_mesh.axis_names:
                raise UsageError(f"`{name}` {axis!r} is not an axis of the mesh, whose axes are "
                                 f"{device_mesh.axis_names}.")
        if replica_dim_name == batch_dim_name:
            raise UsageError(f"`replica_dim_name` and `batch_dim_name` must be two mesh axes, got {batch_dim_name!r} "
                             "for both.")
        if batch_dim_name not in device_mesh.axis_names:
            raise UsageError(f"`batch_dim_name` {batch_dim_name!r} is not an axis of the mesh, whose axes are "
                             f"{device_mesh.axis_names}.")
        if agreement is None and any(d.process_index != jax.process_index() for d in device_mesh.devices.flat):
            raise UsageError("the mesh spans several processes that did not join through lockstep: start the workers "
                             "with `lockstep launch` (or set LOCKSTEP_*, TF_CONFIG or SLURM, or pass "
                             "`cluster_resolver`), build the mesh as ls.DeviceMesh(shape, axis_names) without "
                             "`devices` and the strategy before any JAX computation, instead of calling "
                             "jax.distributed.initialize (or keras.distribution.initialize) yourself.")
        rules = tuple(as_layout_map(layout_map).items())
        config = ShardingConfig(rules, zero_stage, int(min_shard_size), shard_dim, float(max_replicated_fraction))
        batch_axis = batch_dim_name if replica_dim_name is None else (replica_dim_name, batch_dim_name)
        config.check(dict(zip(device_mesh.axis_names, device_mesh.shape)), batch_axis)
        self.device_mesh = device_mesh
        self.zero_stage = zero_stage
        super().__init__(mesh=device_mesh.jax_mesh, batch_axis=batch_axis, sharding=config)
        #: whether every worker's strategy lays variables out alike (checked once here, a collective):
        #: split variables are then made in their shards across the workers (the scope's Keras hooks)
        self.layouts_agreed = agreement is None or _same_on_every_worker(repr((config, batch_axis, device_mesh.shape)))
        if agreement is not None:
            self.extended.agree_on_programs(agreement)

    @property
    def num_workers(self) -> int:
        """How many worker processes the job has."""
        return 1 if self.cluster_resolver is None else self.cluster_resolver.num_workers

    @property
    def worker_index(self) -> int:
        """This worker's number (0: the chief, which writes files)."""
        return 0 if self.cluster_resolver is None else self.cluster_resolver.process_id

    def keras_variable_layout(self, variable: Any) -> Any:
        """Where a Keras variable created in this scope lies from the start (Keras asks)."""
        config = self.extended.sharding
        spec = config.layout_of(self.mesh, self.extended.batch_axis, variable.path, tuple(variable.shape),
                                variable.dtype, bool(variable.trainable))
        return NamedSharding(self.mesh, spec)

    def __repr__(self) -> str:
        return (f"ShardedStrategy(mesh={self.device_mesh.shape} {self.device_mesh.axis_names}, "
                f"zero_stage={self.zero_stage}, num_replicas_in_sync={self.num_replicas_in_sync})")
