"""`ReduceOp`: how values are combined across replicas."""

from __future__ import annotations

import enum
from typing import Any

#: names TF users reach for that lockstep has no `ReduceOp` for, and what to write instead
_INSTEAD = {
    "SUM_OVER_SIZE": "`ReduceOp.MEAN` (weighted by each replica's real samples: the mean over all samples), or "
                     "`ls.compute_average_loss` for a loss; a metric's reduction is declared by the metric itself "
                     "(`ls.metrics.F1Score` is exact on any number of replicas: its counts are summed, never averaged)",
    "SUM_OVER_BATCH_SIZE": "`ReduceOp.MEAN` (the mean over all real samples), or `ls.compute_average_loss`",
    "NONE": "no reduction: read per-replica values with `strategy.experimental_local_results` or `strategy.gather`",
    "AUTO": "`ReduceOp.SUM` or `ReduceOp.MEAN` explicitly",
}


class _ReduceOpType(enum.EnumMeta):
    def __getattr__(cls, name: str) -> Any:
        if name in _INSTEAD:
            raise AttributeError(f"ReduceOp has no {name} (TF has none either: its ReduceOp is SUM and MEAN); "
                                 f"use {_INSTEAD[name]}. See docs/from-tf-distribute.md.")
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"ReduceOp has no {name}: it is one of SUM, MEAN, MAX, MIN.")


class ReduceOp(enum.Enum, metaclass=_ReduceOpType):
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
        if isinstance(op, str) and op.upper() in _INSTEAD:
            raise ValueError(f"`op` must be one of ReduceOp.SUM, MEAN, MAX, MIN, got op={op!r}: use {_INSTEAD[op.upper()]}.")
        raise ValueError(
            f"`op` must be one of ReduceOp.SUM, MEAN, MAX, MIN (or their names), got op={op!r}."
        )
