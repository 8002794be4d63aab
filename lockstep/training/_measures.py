"""`TrainerMeasures`: what a `Trainer` can say about its own training step and its last `fit`'s
time, for `lockstep.callbacks.Goodput` and benchmarks: XLA's memory and cost analyses of the
compiled training program, the rows trained, the time spent waiting for data and in callbacks.
"""

from __future__ import annotations

from typing import Any

import jax


class TrainerMeasures:
    """Mixed into `Trainer` (it reads `_runner`, `_stream` and `_cblist`)."""

    _runner: Any
    _stream: Any
    _cblist: Any

    def step_memory(self) -> dict[str, int] | None:
        """Bytes one device holds while the training step runs, as XLA compiled it (the program of
        the last `fit`'s most frequent call): its arguments (state, batch), outputs, temporaries
        (activations, gradients) and their peak sum; None before the first step."""
        compiled = None if self._runner is None else self._runner.compiled()
        if compiled is None:
            return None
        m = compiled[0].memory_analysis()
        out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
               "temporaries": m.temp_size_in_bytes}
        return {**out, "peak": out["arguments"] + out["outputs"] - m.alias_size_in_bytes + out["temporaries"]}

    def step_cost(self) -> dict[str, Any] | None:
        """One optimizer step's FLOPs on one device, from XLA's cost analysis of the compiled
        training program (divided by the updates each call takes), and the device's kind; None
        before the first step."""
        compiled = None if self._runner is None else self._runner.compiled()
        if compiled is None:
            return None
        executable, updates = compiled
        cost = executable.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return {"flops": float(cost.get("flops", 0.0)) / updates, "device_kind": jax.devices()[0].device_kind}

    def fit_counters(self) -> dict[str, Any]:
        """The running counts of the `fit` in progress (or the last): real rows trained
        (``samples``), seconds waiting for the next batch (``input_s``), each callback's seconds
        in the training hooks (``callback_s``, by `id`) and which callbacks write checkpoints."""
        stream, cblist = self._stream, self._cblist
        return {"samples": 0 if stream is None else stream.samples,
                "input_s": 0.0 if stream is None else stream.input_seconds,
                "callback_s": {} if cblist is None else dict(cblist.seconds),
                "checkpointers": frozenset() if cblist is None else frozenset(cblist.checkpointers)}
