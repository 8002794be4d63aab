"""`TrainerMeasures`: what a `Trainer` can say about its own training step and its last `fit`'s
time, for `lockstep.callbacks.Goodput` and benchmarks: XLA's memory and cost analyses of the
compiled training program, the rows trained, the time spent waiting for data and in callbacks.
"""

from __future__ import annotations

from typing import Any

import jax

from ..data import DataStream
from ._executions import executions
from ._flops import matmul_flops
from ._inputs import first_batch, to_batches


class TrainerMeasures:
    """Mixed into `Trainer` (it reads `_runner`, `_stream`, `_cblist`, `model`, `strategy`, `_state` and
    `_optimizer`; `step_memory` of data builds the model as `fit` does)."""

    _runner: Any
    _stream: Any
    _cblist: Any
    _optimizer: Any
    model: Any
    strategy: Any
    _state: Any
    _engine: Any
    _layout: Any
    _planned: Any = None  # the state's shapes a `step_memory` of data compiled the step for, none placed
    _accumulation: int
    steps_per_execution: int
    _build: Any
    _fresh_state: Any

    def step_memory(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                    sample_weight: Any = None) -> dict[str, int] | None:
        """Bytes one device holds while the training step runs: as XLA compiled it (the program of
        the last `fit`'s most frequent call), its arguments (state, batch), outputs, temporaries
        (activations, gradients) and their peak sum (``peak``); the Keras model's and Keras
        optimizer's own variables where the device holds them beside the step (``keras_variables``:
        those of arrays a sharded state stores padded; `fit` lends the others the state itself);
        and both together (``device_peak``: 0.97-1.00 of the measured peak on CPU in benchmarks/MEMORY_PEAK.md; on an
        H100, benchmarks/GPU.md, ``peak`` alone was the measured peak, 8,673 MiB).

        Given data as `fit` takes it (`x`, `y`, `batch_size`, `sample_weight`; arrays, or a
        dataset that can be read again), the figures of the first program `fit` would run on it,
        compiled and not run (an ahead-of-time compile, as MaxText's `train_compile`), so whether a
        step fits a device is known before one runs (try batch sizes until one fits). The model is
        built as `fit` builds it; a state it has not yet is compiled from its shapes where they would
        lie, and none of it is placed until the state is first used (a step too large is found out
        without the trainer's copy of the parameters and its optimizer state; a Keras optimizer
        object's own slots exist already, made when the trainer took it); with several workers,
        every worker calls it, and the state's first use after it (`learning_rate`, `train_state`,
        `restore`, `get_weights`) places it: a collective too. Without data: None before any step.

        >>> import lockstep as ls, numpy as np, keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> trainer = ls.Trainer(model, loss="mse", strategy=ls.MirroredStrategy(2))
        >>> x, y = np.ones((64, 4)), np.ones((64, 2))
        >>> small, large = (trainer.step_memory(x, y, batch_size=b)["peak"] for b in (8, 64))
        >>> trainer.global_step, 0 < small < large
        (0, True)
        """
        key, state = (None, self._planned if self._state is None else self._state) if x is None else \
            self._compile_first_step(x, y, batch_size, sample_weight)
        compiled = None if self._runner is None else self._runner.compiled(key)
        if compiled is None:
            return None
        m = compiled[1].memory_analysis()
        out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
               "temporaries": m.temp_size_in_bytes}
        out["peak"] = out["arguments"] + out["outputs"] - m.alias_size_in_bytes + out["temporaries"]
        out["keras_variables"] = self._keras_variable_bytes(state)
        return {**out, "device_peak": out["peak"] + out["keras_variables"]}

    def _compile_first_step(self, x: Any, y: Any, batch_size: int | None, sample_weight: Any) -> tuple[Any, Any]:
        """Builds the model on `x`'s first batch and makes the programs of `fit`'s first execution
        on this data, running none; returns the first program's key and the state it is made for
        (without a state placed, its shapes where they would lie)."""
        train = to_batches(self.strategy, x, y, sample_weight, batch_size, False, 0)
        if getattr(train, "one_shot", False):
            raise ValueError(f"step_memory(x=...) reads x's first batches, which `fit` would then miss: x is an "
                             f"iterator ({type(x).__name__}); give arrays or a dataset that can be read again.")
        abstract = self._state is None  # a model without a state yet: none is placed for this
        try:
            self._build(first_batch(train), "x", place=not abstract)
            stream = DataStream(self._engine, train, None, self._accumulation, epochs=1)
            try:
                _, updates = next(executions(stream.epoch(0), self._accumulation, self.steps_per_execution))
                return self._runner.prepare(self._state.replace(metric_state=self._fresh_state()), updates), self._state
            finally:
                stream.close()
        finally:
            if abstract:
                self._planned, self._state = self._state, None  # (what `step_memory()` then reads)

    def _keras_variable_bytes(self, state: Any) -> int:
        """Bytes of the Keras model's and Keras optimizer's variables on this process's first device
        of the strategy, each buffer once, but those of the trainer's state and those `fit` lends
        the state as it begins (`lend_state`: all but those of a sharded state's arrays stored
        padded). A device holds the rest beside a step: their own buffers, or those of a state
        `fit` left them (`sync_model`), which the next step's state no longer is."""
        device = next((d for d in self.strategy.devices if d.process_index == jax.process_index()), None)
        variables = [*getattr(self.model, "variables", ()), *self._optimizer.variables]
        lent = {id(v) for v in [  # (their own buffers freed as `fit` begins)
            *self._adapter.lent_variables(self._layout.unpadded_params(state.params, cut=False)),
            *self._optimizer.lent_variables(self._layout.unpadded_state(state.opt_state, cut=False))]}
        variables = [v for v in variables if id(v) not in lent]
        held = {id(a) for a in jax.tree.leaves((state.params, state.opt_state))}
        arrays = [a for a in (getattr(v, "_value", None) for v in variables) if isinstance(a, jax.Array)
                  and id(a) not in held and not a.is_deleted()]  # (lent the state: counted there; or taken over)
        counted: set[int] = set()
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
