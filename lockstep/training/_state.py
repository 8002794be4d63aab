"""`TrainState`: the whole state of a `fit` in progress, one pytree of plain arrays and numbers."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .._cross_replica import broadcast_from_chief


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a `fit` needs to continue exactly where it was: read it with
    `trainer.train_state`, put it back with `trainer.restore(state)`.

    Checkpoints (`BackupAndRestore`) save this pytree and nothing else, so a new piece of state
    cannot be forgotten by backups.

    Attributes:
      params: ``{"trainable": ..., "non_trainable": ...}``, arrays replicated on every device.
      opt_state: the optax optimizer state, replicated.
      metric_state: the running loss and metric states of the epoch in progress, one entry per
        replica (global arrays whose leading axis is the replica), or None outside `fit`.
      epoch: epochs completed.
      step: batches completed in the epoch in progress.
      global_step: optimizer steps taken in this `fit` (over all epochs).
      seed: the seed of `fit`'s shuffling (the order of an epoch derives from seed and epoch).
      callbacks: each callback's `get_state()`, keyed by class name and rank among callbacks of
        that class (``"EarlyStopping.0"``).

    >>> import lockstep as ls
    >>> s = ls.TrainState(params={"trainable": [], "non_trainable": []}, opt_state=(), metric_state=None,
    ...                   epoch=2, step=5, global_step=25, seed=0, callbacks={})
    >>> (s.epoch, s.step, s.global_step)
    (2, 5, 25)
    """

    params: Any
    opt_state: Any
    metric_state: Any
    epoch: int
    step: int
    global_step: int
    seed: int
    callbacks: dict[str, dict[str, Any]]

    def replace(self, **changes: Any) -> "TrainState":
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState, data_fields=["params", "opt_state", "metric_state", "callbacks"],
    meta_fields=["epoch", "step", "global_step", "seed"])


def callback_key(callbacks: list[Any]) -> dict[str, Any]:
    """Callbacks keyed by class name and rank among that class (``"EarlyStopping.0"``), so a
    restart whose callback list differs restores each saved state into the matching callback."""
    seen: dict[str, int] = {}
    out = {}
    for cb in callbacks:
        name = type(cb).__name__
        out[f"{name}.{seen.get(name, 0)}"] = cb
        seen[name] = seen.get(name, 0) + 1
    return out


class LiveState:
    """A `Trainer`'s training state as it runs: plain global arrays placed by `engine`
    (`strategy.extended`) and the position counters; `snapshot` / `restore` convert to and from
    `TrainState`."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.params: Any = None
        self.opt_state: Any = None
        self.metric_state: Any = None
        self.epoch = self.step = self.global_step = self.seed = 0
        self.callbacks: list[Any] = []
        self._pending: TrainState | None = None

    def place(self, params: Any, init_optimizer: Any) -> None:
        """Worker 0's `params` (host arrays) on every device, with a fresh optimizer state
        (`init_optimizer(trainable params)`)."""
        params = jax.tree.map(np.asarray, broadcast_from_chief(params))  # every worker starts from worker 0's
        self.params = self._engine.put_replicated(params)
        self.opt_state = self._engine.put_replicated(init_optimizer(self.params["trainable"]))

    def snapshot(self) -> TrainState:
        return TrainState(params=self.params, opt_state=self.opt_state, metric_state=self.metric_state,
                          epoch=self.epoch, step=self.step, global_step=self.global_step, seed=self.seed,
                          callbacks={k: cb.get_state() for k, cb in callback_key(self.callbacks).items()})

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
        self.epoch, self.step, self.global_step, self.seed = state.epoch, state.step, state.global_step, state.seed
        if state.step and state.metric_state is not None:  # mid-epoch: the epoch's running metrics go on
            self.metric_state = self._engine.place_per_replica(state.metric_state)
        for key, cb in callback_key(callbacks).items():
            if key in state.callbacks:  # a callback new since the state was taken keeps its fresh state
                cb.set_state(state.callbacks[key])
