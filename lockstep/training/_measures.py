"""`TrainerMeasures`: what a `Trainer` can say about its own training step and its last `fit`'s
time, for `lockstep.callbacks.Goodput` and benchmarks: XLA's memory and cost analyses of the
compiled training program, the rows trained, the time spent waiting for data and in callbacks.
"""

from __future__ import annotations

from typing import Any

import jax

from ._flops import matmul_flops


class TrainerMeasures:
    """Mixed into `Trainer` (it reads `_runner`, `_stream`, `_cblist`, `model`, `strategy`, `_state` and
    `_keras_optimizer`)."""

    _runner: Any
    _stream: Any
    _cblist: Any
    _keras_optimizer: Any
    model: Any
    strategy: Any
    _state: Any

    def step_memory(self) -> dict[str, int] | None:
        """Bytes one device holds while the training step runs: as XLA compiled it (the program of
        the last `fit`'s most frequent call), its arguments (state, batch), outputs, temporaries
        (activations, gradients) and their peak sum (``peak``); the Keras model's and Keras
        optimizer's own variables, which the device holds beside the step (``keras_variables``);
        and both together (``device_peak``: within 2% of the measured peak in
        benchmarks/MEMORY_PEAK.md). None before the first step."""
        compiled = None if self._runner is None else self._runner.compiled()
        if compiled is None:
            return None
        m = compiled[1].memory_analysis()
        out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
               "temporaries": m.temp_size_in_bytes}
        out["peak"] = out["arguments"] + out["outputs"] - m.alias_size_in_bytes + out["temporaries"]
        out["keras_variables"] = self._keras_variable_bytes()
        return {**out, "device_peak": out["peak"] + out["keras_variables"]}

    def _keras_variable_bytes(self) -> int:
        """Bytes of the Keras model's and Keras optimizer's variables on this process's first device
        of the strategy, each buffer once and none the training state holds (Keras variables may
        be lent the state's arrays)."""
        device = next((d for d in self.strategy.devices if d.process_index == jax.process_index()), None)
        variables = [*getattr(self.model, "variables", ()), *getattr(self._keras_optimizer, "variables", ())]
        arrays = [a for a in (getattr(v, "_value", None) for v in variables) if isinstance(a, jax.Array)]
        state = self._state  # as the step holds it (`train_state` would cut padded arrays: a collective)
        counted = {s.data.unsafe_buffer_pointer() for a in jax.tree.leaves((state.params, state.opt_state))
                   if isinstance(a, jax.Array) for s in a.addressable_shards if s.device == device}
        total = 0
        for s in (s for a in arrays for s in a.addressable_shards if s.device == device):
            if s.data.unsafe_buffer_pointer() not in counted:
                counted.add(s.data.unsafe_buffer_pointer())
                total += s.data.nbytes
        return total

    def step_cost(self) -> dict[str, Any] | None:
        """One optimizer step's FLOPs on one device (its matrix products and convolutions, every
        batch of gradient accumulation; `matmul_flops` of the training program, over its steps and
        devices), and the device's kind; None before the first step."""
        compiled = None if self._runner is None else self._runner.compiled()
        if compiled is None:
            return None
        jaxpr, _, updates = compiled
        flops = matmul_flops(jaxpr) / updates / len(self.strategy.devices)
        return {"flops": flops, "device_kind": jax.devices()[0].device_kind}

    def fit_counters(self) -> dict[str, Any]:
        """The running counts of the `fit` in progress (or the last): real rows trained
        (``samples``), seconds waiting for the next batch (``input_s``), each callback's seconds
        in the training hooks (``callback_s``, by `id`) and which callbacks write checkpoints."""
        stream, cblist = self._stream, self._cblist
        return {"samples": 0 if stream is None else stream.samples,
                "input_s": 0.0 if stream is None else stream.input_seconds,
                "callback_s": {} if cblist is None else dict(cblist.seconds),
                "checkpointers": frozenset() if cblist is None else frozenset(cblist.checkpointers)}

