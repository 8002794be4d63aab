"""A `TrainState` made, read and put back: the state a `Trainer` starts from (`initial_state`), the
state as callbacks and backups read it (`snapshot`), and a restored state checked and placed
(`placed`), then taken up by the `fit` that runs (`take_up`: its data position, callbacks' states).

The trainer holds one immutable `TrainState` between steps; each optimizer update replaces it
(``state = runner.run(state, updates)``), and a restore replaces it in one step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..engine import broadcast_from_chief, spread
from ..data import DataPosition, DataStream
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


def initial_state(layout: Any, params: Any, names: Any = None) -> TrainState:
    """Worker 0's `params` (host arrays) on the devices as `layout` (`lockstep.sharding`'s state
    layout) lays them out, with a fresh optimizer state; `names(params, opt_state)` gives their `StateNames`."""
    leaves, tree = jax.tree.flatten(params)
    own = [i for i, x in enumerate(leaves) if not spread(x)]  # a global array spread over workers is one value
    for i, x in zip(own, broadcast_from_chief([np.asarray(leaves[i]) for i in own])):
        leaves[i] = np.asarray(x)  # every worker starts from worker 0's
    params = jax.tree.unflatten(tree, leaves)
    params = layout.params(params)
    opt_state = layout.init_opt_state(params)
    return TrainState(params=params, opt_state=opt_state, metric_state=None, epoch=0, step=0, global_step=0, seed=0,
                      callbacks={}, names=None if names is None else names(params, opt_state))


def fit_start(state: TrainState, epoch: int, seed: int | None, metric_state: Any, batch_size: int | None,
              accumulation: int) -> TrainState:
    """`state` at the start of a `fit`: epoch `epoch`, no step taken, `metric_state` empty."""
    return state.replace(epoch=epoch, step=0, global_step=0, seed=seed, callbacks={}, metric_state=metric_state,
                         batch_size=batch_size, accumulation=accumulation, data=None)


def snapshot(state: TrainState, callbacks: list[Any], stream: DataStream | None, share: bool = False) -> TrainState:
    """`state` with the callbacks' states and the data position now; `share`: with every worker's
    data checksum and iterator state (a collective)."""
    return state.replace(callbacks={k: cb.get_state() for k, cb in callback_key(callbacks).items()},
                         data=None if stream is None else stream.position(share))


_HOST_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


def per_replica_metric_state(engine: Any, metrics: Any, saved: Any) -> Any:
    """Saved per-replica metric state on this run's replicas: as it was on the same number of
    replicas; else reduced over the saved replicas (each field's declared reduction) into the
    first replica, the others given the empty state."""
    r = engine.num_replicas
    leaves = jax.tree.leaves(saved)
    if not leaves or np.shape(leaves[0])[0] == r:
        return engine.place_per_replica(saved)
    empty = metrics.init()

    def moved(name: str, field: str, value: Any) -> np.ndarray:
        reduction = metrics.metrics[name].state_specs[field].reduction
        if reduction not in _HOST_REDUCE:
            raise ValueError(f"metric `{name}` keeps rows ({field!r}, reduction {reduction!r}): its state cannot "
                             "move to another number of replicas in the middle of an epoch; back up at epoch "
                             "ends (save_freq='epoch') or resume on the same number of replicas.")
        whole = _HOST_REDUCE[reduction](np.asarray(value), axis=0)
        return np.stack([whole] + [np.asarray(empty[name][field])] * (r - 1))
    return engine.place_per_replica(
        {name: {field: moved(name, field, v) for field, v in fields.items()} for name, fields in saved.items()})


def placed(engine: Any, layout: Any, metrics: Any, current: TrainState, state: TrainState) -> TrainState:
    """`state` checked against `current` (the trainer's) and placed on `engine`: the weights and
    optimizer state as `layout` lays them out (whatever mesh they were saved from), the running metric state of an epoch in progress per replica
    (`metrics`, a `MetricCollection`, reduces one taken on another number of replicas).

    Raises:
      TypeError: `state` is not a `TrainState`.
      ValueError: its weights or optimizer state have another structure or shapes than `current`'s.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"`state` must be a lockstep.TrainState, got {type(state).__name__}.")
    for name, mine, theirs in (("params", current.params, state.params),
                               ("opt_state", current.opt_state, state.opt_state)):
        if jax.tree.structure(mine) != jax.tree.structure(theirs):
            raise ValueError(f"`state.{name}` has another structure than this trainer's: "
                             f"{jax.tree.structure(theirs)} vs {jax.tree.structure(mine)}.")
    want = layout.shapes(current.params, current.opt_state)
    for (path, leaf), shape in zip(jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0], want):
        if tuple(np.shape(leaf)) != shape:
            raise ValueError(f"`state` holds an array of shape {tuple(np.shape(leaf))} at "
                             f"{jax.tree_util.keystr(path[1:])} of its {('params', 'opt_state')[path[0].idx]}, "
                             f"where this trainer's has shape {shape}.")
    metric_state = None
    if state.step and state.metric_state is not None:  # mid-epoch: the epoch's running metrics go on
        metric_state = per_replica_metric_state(engine, metrics, state.metric_state)
    return state.replace(params=layout.params(state.params), opt_state=layout.opt_state(state.opt_state),
                         metric_state=metric_state, names=current.names)


def take_up(state: TrainState, fresh: TrainState, stream: DataStream, callbacks: list[Any]) -> TrainState:
    """The restored `state` as the `fit` that runs takes it up (`fresh`: that fit's start, whose batch
    size and accumulation it must share): its data position goes to `stream`, the callbacks'
    states to `callbacks`; an epoch's start gets `fresh`'s empty metric state."""
    for name, saved, now in (("global batch size", state.batch_size, fresh.batch_size),
                             ("gradient_accumulation_steps", state.accumulation, fresh.accumulation)):
        if saved is not None and now is not None and saved != now:
            raise ValueError(
                f"the restored state was taken with {name} {saved}, and this fit uses {now}: the data order "
                f"and the step positions depend on it. Resume with {name} {saved} (the number of workers "
                "and replicas may change).")
    stream.start(state.data or DataPosition(state.epoch, state.step * state.accumulation))  # no position: pass = epoch
    for key, cb in callback_key(callbacks).items():
        if key in state.callbacks:  # a callback new since the state was taken keeps its fresh state
            cb.set_state(state.callbacks[key])
    return state.replace(metric_state=state.metric_state if state.metric_state is not None else fresh.metric_state,
                         batch_size=fresh.batch_size, accumulation=fresh.accumulation, callbacks={}, data=None)
