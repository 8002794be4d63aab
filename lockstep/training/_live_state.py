"""`LiveState`: the state of a `fit` in progress as the trainer holds it between steps, read and
restored as a `TrainState`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..engine._cross_replica import broadcast_from_chief
from ._data_stream import DataPosition, DataStream
from ._state_names import StateNames
from ._train_state import TrainState


def callback_key(callbacks: list[Any]) -> dict[str, Any]:
    """Callbacks keyed by class name and rank among that class (``"EarlyStopping.0"``), so a
    restart whose callback list differs restores each saved state into the matching callback."""
    seen: dict[str, int] = {}
    out = {}
    for cb in callbacks:
        name = getattr(cb, "state_name", None) or type(cb).__name__  # a Keras callback: keras.<its class>
        out[f"{name}.{seen.get(name, 0)}"] = cb
        seen[name] = seen.get(name, 0) + 1
    return out


_HOST_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


class LiveState:
    """A `Trainer`'s training state as it runs: plain global arrays placed by `engine`
    (`strategy.extended`) and the position counters; `snapshot` / `restore` convert to and from
    `TrainState`. `metrics` (a `MetricCollection`) says how to reduce a restored per-replica
    metric state taken on another number of replicas, and gives the empty state."""

    def __init__(self, engine: Any, metrics: Any):
        self._engine = engine
        self._metrics = metrics
        self.params: Any = None
        self.opt_state: Any = None
        self.metric_state: Any = None
        self.epoch = self.step = self.global_step = self.seed = 0
        self.batch_size: int | None = None
        self.accumulation = 1
        self.stream: DataStream | None = None  # fit's training data
        self.callbacks: list[Any] = []
        self._pending: TrainState | None = None
        self.names: StateNames | None = None  # set by the trainer once params and opt_state exist

    def place(self, params: Any, init_optimizer: Any, names: Any = None) -> None:
        """Worker 0's `params` (host arrays) on every device, with a fresh optimizer state
        (`init_optimizer(trainable params)`); `names(params, opt_state)` gives their `StateNames`."""
        params = jax.tree.map(np.asarray, broadcast_from_chief(params))  # every worker starts from worker 0's
        self.params = self._engine.put_replicated(params)
        self.opt_state = self._engine.put_replicated(init_optimizer(self.params["trainable"]))
        self.names = None if names is None else names(self.params, self.opt_state)

    def begin(self, callbacks: list[Any], stream: DataStream, initial_epoch: int, seed: int, metric_state: Any,
              batch_size: int | None, accumulation: int) -> None:
        """The position at the start of a `fit`: epoch `initial_epoch`, no step taken, reading `stream`."""
        self.callbacks, self.stream, self.metric_state = callbacks, stream, metric_state
        self.epoch, self.step, self.global_step, self.seed = initial_epoch, 0, 0, seed
        self.batch_size, self.accumulation = batch_size, accumulation

    def snapshot(self, share: bool = False) -> TrainState:
        """The state now; `share`: with every worker's data checksum and iterator state (a collective)."""
        return TrainState(params=self.params, opt_state=self.opt_state, metric_state=self.metric_state,
                          epoch=self.epoch, step=self.step, global_step=self.global_step, seed=self.seed,
                          callbacks={k: cb.get_state() for k, cb in callback_key(self.callbacks).items()},
                          batch_size=self.batch_size, accumulation=self.accumulation,
                          data=None if self.stream is None else self.stream.position(share), names=self.names)

    def _per_replica(self, saved: Any) -> Any:
        """Saved per-replica metric state on this run's replicas: as it was on the same number of
        replicas; else reduced over the saved replicas (each field's declared reduction) into the
        first replica, the others given the empty state."""
        r = self._engine.distributor.num_replicas
        leaves = jax.tree.leaves(saved)
        if not leaves or np.shape(leaves[0])[0] == r:
            return self._engine.place_per_replica(saved)
        empty = self._metrics.init()

        def moved(name: str, field: str, value: Any) -> np.ndarray:
            reduction = self._metrics.metrics[name].state_specs[field].reduction
            if reduction not in _HOST_REDUCE:
                raise ValueError(f"metric `{name}` keeps rows ({field!r}, reduction {reduction!r}): its state cannot "
                                 "move to another number of replicas in the middle of an epoch; back up at epoch "
                                 "ends (save_freq='epoch') or resume on the same number of replicas.")
            whole = _HOST_REDUCE[reduction](np.asarray(value), axis=0)
            return np.stack([whole] + [np.asarray(empty[name][field])] * (r - 1))
        return self._engine.place_per_replica(
            {name: {field: moved(name, field, v) for field, v in fields.items()} for name, fields in saved.items()})

    def restore(self, state: TrainState) -> None:
        """Weights and optimizer state at once; the rest when `take_pending` is called."""
        if not isinstance(state, TrainState):
            raise TypeError(f"`state` must be a lockstep.TrainState, got {type(state).__name__}.")
        for name, mine, theirs in (("params", self.params, state.params),
                                   ("opt_state", self.opt_state, state.opt_state)):
            if jax.tree.structure(mine) != jax.tree.structure(theirs):
                raise ValueError(f"`state.{name}` has another structure than this trainer's: "
                                 f"{jax.tree.structure(theirs)} vs {jax.tree.structure(mine)}.")
        self.params = self._engine.put_replicated(state.params)
        self.opt_state = self._engine.put_replicated(state.opt_state)
        self._pending = state

    def take_pending(self, callbacks: list[Any]) -> None:
        """Applies a pending `restore`'s position, metric state and callback states."""
        state, self._pending = self._pending, None
        if state is None:
            return
        for name, saved, now in (("global batch size", state.batch_size, self.batch_size),
                                 ("gradient_accumulation_steps", state.accumulation, self.accumulation)):
            if saved is not None and now is not None and saved != now:
                raise ValueError(
                    f"the restored state was taken with {name} {saved}, and this fit uses {now}: the data order "
                    f"and the step positions depend on it. Resume with {name} {saved} (the number of workers "
                    "and replicas may change).")
        self.epoch, self.step, self.global_step, self.seed = state.epoch, state.step, state.global_step, state.seed
        if self.stream is not None:  # a state without a data position (older backups): pass = epoch
            self.stream.start(state.data or DataPosition(state.epoch, state.step * state.accumulation))
        if state.step and state.metric_state is not None:  # mid-epoch: the epoch's running metrics go on
            self.metric_state = self._per_replica(state.metric_state)
        for key, cb in callback_key(callbacks).items():
            if key in state.callbacks:  # a callback new since the state was taken keeps its fresh state
                cb.set_state(state.callbacks[key])
