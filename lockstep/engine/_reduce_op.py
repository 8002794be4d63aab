"""`ReduceOp`: how values are combined across replicas."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How values from several replicas are combined.

    `MEAN` is weighted by each replica's number of real samples in the step
    (padding excluded), so the mean of per-replica means is the mean over all
    samples. Outside a step with a distributed batch every replica weighs one.

    >>> import lockstep as ls
    >>> ls.ReduceOp.SUM
    <ReduceOp.SUM: 'SUM'>
    >>> ls.ReduceOp.from_value("mean")
    <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"

    @classmethod
    def from_value(cls, op: "ReduceOp | str") -> "ReduceOp":
        """Returns the `ReduceOp` named by `op` (a `ReduceOp` or its name, any case).

        Raises:
          ValueError: `op` names no `ReduceOp`.
        """
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise ValueError(
            f"`op` must be one of ReduceOp.SUM, MEAN, MAX, MIN (or their names), got op={op!r}."
        )
