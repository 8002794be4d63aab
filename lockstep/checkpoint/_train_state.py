"""A `TrainState` as a checkpoint: a flat dict of arrays plus JSON, and back (pure functions).

>>> import numpy as np, lockstep as ls
>>> from lockstep.checkpoint import flatten_train_state, unflatten_train_state
>>> s = ls.TrainState(params={"trainable": [np.ones(2)], "non_trainable": []}, opt_state=(np.zeros(2),),
...                   metric_state=None, epoch=1, step=3, global_step=7, seed=0,
...                   callbacks={"EarlyStopping.0": {"wait": 1, "best_weights": [np.ones(2)]}})
>>> arrays, meta = flatten_train_state(s)
>>> sorted(arrays)
['callbacks/EarlyStopping.0/best_weights/00000', 'opt_state/00000', 'params/00000']
>>> back = unflatten_train_state(arrays, meta, like=s)
>>> back.global_step, back.callbacks["EarlyStopping.0"]["wait"], back.params["trainable"][0].tolist()
(7, 1, [1.0, 1.0])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from ..training import TrainState

_ARRAY_TREES = ("params", "opt_state", "metric_state")
_PREFIX = {"params": "params", "opt_state": "opt_state", "metric_state": "metrics"}
#: Names of the metric state's arrays start with this (one entry per replica along axis 0).
METRIC_STATE_PREFIX = "metrics/"


def _split_state(state: dict[str, Any], prefix: str, arrays: dict[str, Any]) -> dict[str, Any]:
    """JSON-able entries stay; lists of arrays move to `arrays` and leave a marker."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, list) and v and all(isinstance(a, (np.ndarray, jax.Array)) for a in v):
            for i, a in enumerate(v):
                arrays[f"{prefix}{k}/{i:05d}"] = np.asarray(a)
            out[k] = {"__arrays__": f"{prefix}{k}/", "count": len(v)}
        else:
            out[k] = v
    return out


def _join_state(state: dict[str, Any], arrays: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict) and "__arrays__" in v:
            out[k] = [np.asarray(arrays[f"{v['__arrays__']}{i:05d}"]) for i in range(v["count"])]
        else:
            out[k] = v
    return out


def flatten_train_state(state: "TrainState") -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, meta): every array of `state` under a flat name, and the rest as JSON-able values."""
    arrays: dict[str, Any] = {}
    for field in _ARRAY_TREES:
        for i, v in enumerate(jax.tree.leaves(getattr(state, field))):
            arrays[f"{_PREFIX[field]}/{i:05d}"] = v
    callbacks = {key: _split_state(cb_state, f"callbacks/{key}/", arrays)
                 for key, cb_state in state.callbacks.items()}
    meta = {"epoch": state.epoch, "step": state.step, "global_step": state.global_step, "seed": state.seed,
            "batch_size": state.batch_size, "accumulation": state.accumulation, "callbacks": callbacks,
            "data": None if state.data is None else state.data.to_json()}
    return arrays, meta


def unflatten_train_state(arrays: dict[str, Any], meta: dict[str, Any], like: "TrainState") -> "TrainState":
    """The `TrainState` that `flatten_train_state` made `arrays` and `meta` from; `like` (a state of
    the same model, optimizer and metrics) gives the structure of its array trees."""
    trees = {}
    for field in _ARRAY_TREES:
        treedef = jax.tree.structure(getattr(like, field))
        trees[field] = jax.tree.unflatten(
            treedef, [arrays[f"{_PREFIX[field]}/{i:05d}"] for i in range(treedef.num_leaves)])
    from ..training import DataPosition  # here: training imports checkpoint

    callbacks = {key: _join_state(cb_state, arrays) for key, cb_state in meta["callbacks"].items()}
    batch_size, data = meta.get("batch_size"), meta.get("data")
    return like.replace(epoch=int(meta["epoch"]), step=int(meta["step"]), global_step=int(meta["global_step"]),
                        data=None if data is None else DataPosition.from_json(data), seed=int(meta["seed"]), batch_size=None if batch_size is None else int(batch_size),
                        accumulation=int(meta.get("accumulation", 1)), callbacks=callbacks, **trees)
