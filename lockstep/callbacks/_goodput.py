"""`Goodput`: where an epoch's time went, and how much of the devices' arithmetic it used.

Per epoch of `fit` it adds to the logs (so `History`, `CSVLogger` and the progress bar show them):

- ``samples_per_s`` (real rows, padding left out) and ``tokens_per_s`` when the model's first input
  is a sequence (integer tokens ``(batch, T)``, or ``(batch, T, features)``);
- ``step_s``: the epoch's training time per optimizer step, split into ``input_s`` (waiting for the
  data pipeline), ``host_s`` (other callbacks' hooks, the progress bar's included),
  ``checkpoint_s`` (backups and checkpoints written during the epoch) and ``compute_s`` (the rest:
  the devices' work and the host's dispatch of it), each per step; validation is not counted;
- ``flops_per_step`` (the training step's matrix products, convolutions and fused attention, one
  device's share; see `lockstep.training._flops`),
  ``flop_per_s`` (achieved, per device) and ``mfu`` (that over the device's peak, when lockstep
  knows the device: H100, H200, A100, L4, V100, TPU v4 / v5e / v5p; CPU: no `mfu`).

The numbers are this worker's own (timings differ between workers); they never enter a decision.

>>> import lockstep as ls, numpy as np, keras
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> trainer = ls.Trainer(model, loss="mse", strategy=ls.MirroredStrategy(2))
>>> logs = trainer.fit(np.ones((10, 4)), np.ones((10, 2)), batch_size=4, callbacks=[Goodput()], verbose=0).history
>>> sorted(k for k in logs if k.endswith("_s") or k.startswith("flop"))
['checkpoint_s', 'compute_s', 'flop_per_s', 'flops_per_step', 'host_s', 'input_s', 'samples_per_s', 'step_s']
>>> logs["flops_per_step"][0] > 0
True
"""

from __future__ import annotations

import time
from typing import Any

from ._callback import Callback

#: dense bfloat16 FLOP/s of one device (its datasheet's), by a part of `jax.Device.device_kind`
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "V100": 125e12,
              "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12}


def peak_flops(device_kind: str) -> float | None:
    """A device's peak dense bfloat16 FLOP/s from its kind, or None when lockstep does not know it.

    >>> peak_flops("NVIDIA H100 80GB HBM3"), peak_flops("cpu")
    (989000000000000.0, None)
    """
    for part, flops in PEAK_FLOPS.items():
        if part.lower() in device_kind.lower():
            return flops
    return None


def sequence_length(model: Any) -> int | None:
    """Tokens per sample when the model's first input is a sequence (see the module doc), else None."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        return None
    shape, dtype = tuple(inputs[0].shape), str(getattr(inputs[0], "dtype", ""))
    if len(shape) == 3 or (len(shape) == 2 and "int" in dtype):
        return shape[1] if isinstance(shape[1], int) else None
    return None


class Goodput(Callback):
    """Adds each epoch's throughput, time split and FLOP use to its logs (see the module doc);
    `epochs` keeps them too. `peak_flops`: the device's peak FLOP/s, for a device lockstep does
    not know (or to count another precision's peak)."""

    stops_in_batches = False

    def __init__(self, peak_flops: float | None = None):
        super().__init__()
        self.peak = peak_flops
        self.epochs: list[dict[str, float]] = []
        self._start: dict[str, Any] = {}
        self._validating = 0.0
        self._test_began: float | None = None

    def _counters(self) -> dict[str, Any]:
        trainer = self.model
        assert trainer is not None
        counters = trainer.fit_counters()
        return {"time": time.perf_counter(), "step": trainer.global_step, **counters}

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start, self._validating = self._counters(), 0.0

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._test_began = time.perf_counter()

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._test_began is not None:
            self._validating += time.perf_counter() - self._test_began
            self._test_began = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._start:
            return
        trainer, start, end = self.model, self._start, self._counters()
        assert trainer is not None
        wall = end["time"] - start["time"] - self._validating - (end["callback_s"][id(self)] - start["callback_s"].get(
            id(self), 0.0))
        steps = max(end["step"] - start["step"], 1)
        spent = {cb: s - start["callback_s"].get(cb, 0.0) for cb, s in end["callback_s"].items() if cb != id(self)}
        checkpoint = sum(s for cb, s in spent.items() if cb in end["checkpointers"])
        host = sum(s for cb, s in spent.items() if cb not in end["checkpointers"])
        waited = end["input_s"] - start["input_s"]
        out = {"samples_per_s": (end["samples"] - start["samples"]) / wall, "step_s": wall / steps,
               "input_s": waited / steps, "host_s": host / steps, "checkpoint_s": checkpoint / steps,
               "compute_s": max(wall - waited - host - checkpoint, 0.0) / steps}
        length = sequence_length(trainer.model)
        if length is not None:
            out["tokens_per_s"] = out["samples_per_s"] * length
        cost = trainer.step_cost()
        if cost is not None:
            out["flops_per_step"] = cost["flops"]
            out["flop_per_s"] = cost["flops"] / out["step_s"]
            peak = self.peak or peak_flops(cost["device_kind"])
            if peak:
                out["mfu"] = out["flop_per_s"] / peak
        self.epochs.append(out)
        if logs is not None:
            logs.update(out)
