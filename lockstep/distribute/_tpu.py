"""`TPUStrategy`: the engine of `MirroredStrategy` on this TPU VM's cores."""

from __future__ import annotations

import jax

from ._strategy import Strategy


def _tpu_devices() -> list[jax.Device]:
    """This process's TPU devices; a clear error naming the alternative where there is none."""
    try:
        tpus = jax.local_devices(backend="tpu")
    except RuntimeError as e:
        found = jax.local_devices()
        raise RuntimeError(
            f"TPUStrategy needs TPU devices, and JAX finds none here ({len(found)} {found[0].platform} device(s); "
            f"{str(e).splitlines()[0]}). On this machine use `lockstep.MirroredStrategy()` (every local device) "
            "or `lockstep.OneDeviceStrategy()`: the same API and numbers.") from None
    return list(tpus)


class TPUStrategy(Strategy):
    """Synchronous data parallelism over the TPU cores of this TPU VM: the engine, API and
    exactness of `MirroredStrategy`, on TPU devices.

    Tested here only for the error without a TPU, and for the engine on CPU devices standing in for
    TPU cores; no TPU was at hand. Several hosts (a pod slice): run one process per host with
    `MultiWorkerMirroredStrategy` (it spans every host's devices, with lockstep's failure watchdog).

    Args:
      tpu: ``None``, ``""`` or ``"local"``: this machine's TPUs. JAX reaches only the TPUs of the
        machine it runs on, so a TPU name or ``grpc://`` address (TF's `TPUClusterResolver`) is refused.

    Raises:
      RuntimeError: no TPU on this machine (the message names `MirroredStrategy`), or a
        multi-process JAX job (use `MultiWorkerMirroredStrategy`).
      ValueError: `tpu` names a remote TPU.
    """

    def __init__(self, tpu: str | None = None):
        if tpu not in (None, "", "local"):
            raise ValueError(
                f"`tpu` must be None, '' or 'local' (this machine's TPUs), got tpu={tpu!r}: JAX runs on the TPU VM "
                "itself, not on a remote TPU by name or address; start the program on the TPU VM.")
        devices = _tpu_devices()
        if jax.process_count() > 1:
            raise RuntimeError(
                f"TPUStrategy spans one host's TPUs, but this JAX job has {jax.process_count()} processes: use "
                "`lockstep.MultiWorkerMirroredStrategy()` for a pod slice.")
        super().__init__(devices)
