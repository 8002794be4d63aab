"""`tf.distribute`'s ``strategy.extended``: the engine, with the facts TF's API reads off it
(which devices hold the variables, which worker writes checkpoints and summaries).
"""

from __future__ import annotations

import jax

from ..engine import Engine


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
