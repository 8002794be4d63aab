"""TF's choices of collective implementation (`cross_device_ops=`, `communication_options=`),
accepted so that TF code runs as written, and recorded: lockstep's collectives are XLA's
(all-reduce inside the compiled step, over NCCL on GPUs and gloo between CPU workers), whatever
is chosen, and the numbers do not depend on it.

>>> import lockstep as ls
>>> ls.MirroredStrategy(2, cross_device_ops=ls.HierarchicalCopyAllReduce()).num_replicas_in_sync
2
>>> ls.experimental.CommunicationOptions(implementation=ls.experimental.CommunicationImplementation.NCCL)
CommunicationOptions(bytes_per_pack=0, timeout_seconds=None, implementation=<CommunicationImplementation.NCCL: 'NCCL'>)
"""

from __future__ import annotations

import enum
from typing import Any


class CrossDeviceOps:
    """TF's base class of all-reduce algorithms; lockstep's steps use XLA's all-reduce whichever is given."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NcclAllReduce(CrossDeviceOps):
    """TF's NCCL all-reduce: XLA's all-reduce is NCCL's on GPUs already."""


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """TF's hierarchical copy all-reduce: XLA's all-reduce is used."""


class ReductionToOneDevice(CrossDeviceOps):
    """TF's reduction on one device: XLA's all-reduce is used."""


class CommunicationImplementation(enum.Enum):
    """TF's collective implementations (`tf.distribute.experimental.CommunicationImplementation`)."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """TF's `tf.distribute.experimental.CommunicationOptions`: recorded; `timeout_seconds` is
    lockstep's `failure_timeout` when that is not given."""

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds: float | None = None,
                 implementation: CommunicationImplementation = CommunicationImplementation.AUTO):
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"`timeout_seconds` must be positive or None, got timeout_seconds={timeout_seconds!r}.")
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def __repr__(self) -> str:
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, timeout_seconds={self.timeout_seconds}, "
                f"implementation={self.implementation!r})")


def checked_cross_device_ops(value: Any) -> Any:
    """`cross_device_ops` as given (None or a `CrossDeviceOps`, lockstep's or TF's)."""
    if value is not None and not (isinstance(value, CrossDeviceOps) or type(value).__name__ in _TF_NAMES):
        raise TypeError(f"`cross_device_ops` must be None or a CrossDeviceOps (say ls.NcclAllReduce()), got {value!r}.")
    return value


def checked_communication_options(value: Any) -> Any:
    """`communication_options` as given (None or a `CommunicationOptions`, lockstep's or TF's)."""
    if value is not None and type(value).__name__ != "CommunicationOptions":
        raise TypeError(f"`communication_options` must be None or a CommunicationOptions, got {value!r}.")
    return value


_TF_NAMES = {"NcclAllReduce", "HierarchicalCopyAllReduce", "ReductionToOneDevice", "CrossDeviceOps"}
