"""`tf.distribute`'s ``strategy.extended``: the engine, with the facts TF's API reads off it
(which devices hold the variables, which worker writes checkpoints and summaries) and how the
strategy lays a model's variables out (`sharding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from ..engine import BATCH_AXIS, Engine
from ..sharding import ShardingConfig


class StrategyExtended(Engine):
    """The engine under a strategy, on plain arrays (`tf.distribute`'s ``strategy.extended``).

    >>> import lockstep as ls, numpy as np
    >>> s = ls.MirroredStrategy(2)
    >>> total, = s.extended.run_arrays(lambda v: (ls.get_replica_context().all_reduce("SUM", v),),
    ...                                (np.array([[1.0], [2.0]]),), kinds=("per_replica",),
    ...                                out_kinds=("replicated",))
    >>> total.tolist()
    [3.0]
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None, owner: Any = None, *, mesh: Mesh | None = None,
                 batch_axis: str | tuple[str, ...] = BATCH_AXIS, sharding: ShardingConfig | None = None):
        super().__init__(devices, owner, mesh=mesh, batch_axis=batch_axis, split_model_axes=sharding is not None)
        #: how the strategy lays a model's variables out (None: replicated on every device)
        self.sharding = sharding

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's devices among the strategy's (TF's ``extended.worker_devices``), by name.

        >>> import lockstep as ls
        >>> len(ls.MirroredStrategy(2).extended.worker_devices)
        2
        """
        return tuple(str(d) for d in self.mesh.devices.flat if d.process_index == jax.process_index())

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where this worker holds the variables: a copy on each of its devices (mirrored)."""
        return self.worker_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoints: worker 0 only, as lockstep's callbacks do."""
        return jax.process_index() == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker writes summaries (TensorBoard): worker 0 only."""
        return jax.process_index() == 0
