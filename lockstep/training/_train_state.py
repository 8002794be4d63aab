"""`TrainState`: the whole state of a `fit` in progress, one pytree of plain arrays and numbers;
and as a checkpoint stores it, a flat dict of named arrays plus JSON, and back (pure functions).

>>> import numpy as np, lockstep as ls
>>> from lockstep.training import flatten_train_state, unflatten_train_state
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

import dataclasses
import warnings
from typing import Any, ClassVar

import jax
import numpy as np

from ..data import DataPosition
from ._state_names import StateNames

@dataclasses.dataclass(frozen=True, eq=False)
class LoopRecord:
    """The loop's bookkeeping of a `fit` in progress: where it is and what made it. A checkpoint
    stores it as JSON (the callbacks' arrays aside), beside the step's arrays. It changes between
    epochs and at backups, never with a step.

    Attributes:
      epoch: epochs completed.
      epoch_start: the `global_step` at which the epoch in progress started (the state's `step`,
        steps completed in the epoch, is the difference).
      seed: the seed of `fit`'s shuffling (the order of an epoch derives from seed and epoch; None:
        from NumPy's global random state, as Keras draws it, whose place the data position holds).
      callbacks: each callback's `get_state()`, keyed by class name and rank among callbacks of
        that class (``"EarlyStopping.0"``).
      batch_size: the global batch size of `fit` (None: batches came whole from an iterable).
      accumulation: batches per optimizer step (`gradient_accumulation_steps`). A resume with
        another `batch_size` or `accumulation` is refused: the data order and positions depend on them.
      data: the position in the training data (`DataPosition`: pass, batches consumed, a checksum
        of the last one, Grain iterator states), or None outside `fit`. In a multi-worker job the
        checksum and iterator states are every worker's in backups (`BackupAndRestore` gathers
        them); a worker's own `train_state` leaves them out.
      names: the name of every array of `params` and `opt_state` and what the model and the
        optimizer are (`StateNames`), so a checkpoint is restored by name and checked; None:
        matched by position.
    """

    epoch: int = 0
    epoch_start: int = 0
    seed: int | None = 0
    callbacks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    batch_size: int | None = None
    accumulation: int = 1
    data: DataPosition | None = None
    names: StateNames | None = None


_LOOP_FIELDS = frozenset(f.name for f in dataclasses.fields(LoopRecord)) - {"epoch_start"}


@dataclasses.dataclass(frozen=True, init=False)
class TrainState:
    """Everything a `fit` needs to continue exactly where it was: read it with
    `trainer.train_state`, put it back with `trainer.restore(state)`.

    As flax's ``TrainState``: the step's arrays (`params`, `opt_state`, `metric_state`) and the
    count of optimizer steps (`global_step`), which only `stepped` moves (a pytree of these: the
    count is a leaf, so a function jitted over the state is not compiled again each step); the
    loop's bookkeeping (epoch, seed, callbacks' states, data position, names) is its `loop`, a
    `LoopRecord` (the pytree's static part, changed between epochs only), whose fields it also
    shows as its own (``state.epoch``); `step`, the steps completed in the epoch in progress, is
    `global_step` less the loop's `epoch_start`. Checkpoints
    (`BackupAndRestore`) save this and nothing else, so a new piece of state cannot be forgotten
    by backups.

    Attributes:
      params: ``{"trainable": ..., "non_trainable": ...}``, arrays replicated on every device (or
        laid out by a sharded strategy's plan).
      opt_state: the optax optimizer state, laid out alike.
      metric_state: the running loss and metric states of the epoch in progress, one entry per
        replica (global arrays whose leading axis is the replica), or None outside `fit`. Restored
        onto another number of replicas (W x R taken, W' x R' now), the entries are reduced with
        each field's declared reduction and the result goes to the first replica, the empty state
        to the others; on the same number they are restored as they were (bit for bit).
      global_step: optimizer steps taken in this `fit` (over all epochs).
      loop: the loop's `LoopRecord`.

    Built from the step's arrays and the loop's fields by keyword:

    >>> import lockstep as ls
    >>> s = ls.TrainState(params={"trainable": [], "non_trainable": []}, opt_state=(), metric_state=None,
    ...                   epoch=2, step=5, global_step=25, seed=0, callbacks={})
    >>> (s.epoch, s.step, s.global_step, s.loop.epoch)
    (2, 5, 25, 2)
    """

    params: Any
    opt_state: Any
    metric_state: Any
    global_step: int
    loop: LoopRecord
    #: names of the metric state's arrays in `to_arrays` start with this (one entry per replica along axis 0)
    METRIC_STATE_PREFIX: ClassVar[str] = "metrics/"

    def __init__(self, params: Any, opt_state: Any, metric_state: Any, global_step: int = 0,
                 loop: LoopRecord | None = None, step: int = 0, **loop_fields: Any):
        unknown = loop_fields.keys() - _LOOP_FIELDS
        if unknown:
            raise TypeError(f"TrainState has no field {sorted(unknown)}; its fields are {sorted(_FIELDS)}.")
        if loop is not None and (loop_fields or step):
            raise TypeError(f"give TrainState `loop` or its fields {sorted(loop_fields)}, not both.")
        if loop is None:
            loop = LoopRecord(epoch_start=global_step - step, **loop_fields)
        for name, value in (("params", params), ("opt_state", opt_state), ("metric_state", metric_state),
                            ("global_step", global_step), ("loop", loop)):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:  # the loop's fields, read as the state's own
        if name in _LOOP_FIELDS:
            return getattr(self.__dict__["loop"], name)
        raise AttributeError(f"'TrainState' object has no attribute {name!r}")

    @property
    def step(self) -> int:
        """Optimizer steps completed in the epoch in progress."""
        return self.global_step - self.loop.epoch_start

    def replace(self, **changes: Any) -> TrainState:
        """A copy with `changes` applied, to the step's arrays or the loop's fields (a shallow copy
        rather than `dataclasses.replace`: a step replaces the state thousands of times a second).

        Raises:
          TypeError: a name in `changes` is not a field.
        """
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"TrainState has no field {sorted(unknown)}; its fields are {sorted(_FIELDS)}.")
        step = changes.pop("step", self.step)
        loop = {k: changes.pop(k) for k in list(changes) if k in _LOOP_FIELDS}
        new = object.__new__(TrainState)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        if loop or new.global_step - step != self.loop.epoch_start:
            new.__dict__["loop"] = dataclasses.replace(self.loop, epoch_start=new.global_step - step, **loop)
        return new

    def stepped(self, n: int, params: Any, opt_state: Any, metric_state: Any) -> TrainState:
        """This state after `n` optimizer updates that gave `params`, `opt_state` and
        `metric_state` (flax's `apply_gradients`, the update already made by the compiled
        program): the only way `global_step` (and with it `step`) moves; the loop's record stays.

        >>> import lockstep as ls
        >>> s = ls.TrainState(params={}, opt_state=(), metric_state=None, epoch=0, step=3, global_step=7,
        ...                   seed=0, callbacks={})
        >>> t = s.stepped(2, {"trainable": []}, (), None)
        >>> (t.step, t.global_step, t.params)
        (5, 9, {'trainable': []})
        """
        new = object.__new__(TrainState)
        new.__dict__.update(params=params, opt_state=opt_state, metric_state=metric_state,
                            global_step=self.global_step + n, loop=self.loop)
        return new

    def to_arrays(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """`flatten_train_state(self)`: what a checkpoint stores (named arrays, JSON)."""
        return flatten_train_state(self)

    def from_arrays(self, arrays: dict[str, Any], meta: dict[str, Any]) -> TrainState:
        """`unflatten_train_state(arrays, meta, like=self)`: the state a checkpoint stored."""
        return unflatten_train_state(arrays, meta, self)


_STEP_FIELDS = ("params", "opt_state", "metric_state", "global_step")


def _train_state_flatten(state: TrainState) -> tuple[tuple[Any, ...], LoopRecord]:
    return tuple(state.__dict__[k] for k in _STEP_FIELDS), state.loop


def _train_state_unflatten(loop: LoopRecord, children: Any) -> TrainState:
    new = object.__new__(TrainState)
    new.__dict__.update(zip(_STEP_FIELDS, children), loop=loop)
    return new


# a pytree of the step's arrays and its count; the loop's record is its static part
jax.tree_util.register_pytree_node(TrainState, _train_state_flatten, _train_state_unflatten)


_PREFIX = {"params": "params", "opt_state": "opt_state"}
METRIC_STATE_PREFIX = TrainState.METRIC_STATE_PREFIX


_FIELDS = frozenset({*_STEP_FIELDS, "loop", "step"}) | _LOOP_FIELDS

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


def _metric_names(metric_state: Any) -> list[tuple[str, str]] | None:
    """(metric, field) of every array of a metric state keyed by metric name and field, else None."""
    if not isinstance(metric_state, dict) or not all(isinstance(v, dict) for v in metric_state.values()):
        return None
    return [(name, field) for name in sorted(metric_state) for field in sorted(metric_state[name])]


def flatten_train_state(state: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, meta): every array of `state` under a flat name, and the rest as JSON-able values.
    The metric state's arrays are named by metric and field (``metrics/accuracy/total``), so a
    restore matches them by name."""
    arrays: dict[str, Any] = {}
    for field in ("params", "opt_state"):
        for i, v in enumerate(jax.tree.leaves(getattr(state, field))):
            arrays[f"{_PREFIX[field]}/{i:05d}"] = v
    named = _metric_names(state.metric_state)
    if named is None:
        for i, v in enumerate(jax.tree.leaves(state.metric_state)):
            arrays[f"{METRIC_STATE_PREFIX}{i:05d}"] = v
    else:
        for name, f in named:
            arrays[f"{METRIC_STATE_PREFIX}{name}/{f}"] = state.metric_state[name][f]
    callbacks = {key: _split_state(cb_state, f"callbacks/{key}/", arrays)
                 for key, cb_state in state.callbacks.items()}
    meta = {"epoch": state.epoch, "step": state.step, "global_step": state.global_step, "seed": state.seed,
            "batch_size": state.batch_size, "accumulation": state.accumulation, "callbacks": callbacks,
            "data": None if state.data is None else state.data.to_json(),
            "names": None if state.names is None else state.names.to_json()}
    return arrays, meta


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


_WHAT = {"params": "the model's weights", "opt_state": "the optimizer's state"}


def _refused(what: str, field: str) -> ValueError:
    return ValueError(f"the backup does not fit this trainer: {what}. The {'model' if field == 'params' else 'optimizer'} "
                      "changed since the backup was taken (another layer, layer width, number of classes or "
                      "optimizer); resume with the same one, or delete the backup to start over.")


def _checked_tree(arrays: dict[str, Any], field: str, like: Any, saved_names: tuple[str, ...] | None,
                  names: tuple[str, ...] | None) -> Any:
    """`field`'s tree from `arrays`, each array matched to `like`'s by name (by position in
    backups without names) and checked in shape and dtype."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = [leaf for _, leaf in with_paths]
    prefix = f"{_PREFIX[field]}/"
    saved = sorted(k for k in arrays if k.startswith(prefix))
    if saved_names is not None and names is not None and len(names) == len(leaves):
        where = {n: f"{prefix}{i:05d}" for i, n in enumerate(saved_names)}
        missing = [n for n in names if n not in where]
        extra = [n for n in saved_names if n not in set(names)]
        if missing or extra:
            raise _refused(f"{_WHAT[field]} differ by name: {missing[:3] or 'none'} here "
                           f"{'is' if len(missing) == 1 else 'are'} not in the backup, and the backup's "
                           f"{extra[:3] or 'none'} {'is' if len(extra) == 1 else 'are'} not here", field)
        keys, labels = [where[n] for n in names], [f"`{n}` of {_WHAT[field]} ({where[n]})" for n in names]
    else:
        if len(saved) != len(leaves):
            raise _refused(f"it holds {len(saved)} arrays of {_WHAT[field]}, this trainer has {len(leaves)}", field)
        keys = [f"{prefix}{i:05d}" for i in range(len(leaves))]
        labels = [f"array {i} of {_WHAT[field]} ({keys[i]}, {field}{jax.tree_util.keystr(p)})"
                  for i, (p, _) in enumerate(with_paths)]
    out = []
    for key, label, mine in zip(keys, labels, leaves):
        theirs = arrays[key]
        if tuple(np.shape(theirs)) != tuple(np.shape(mine)) or _dtype(theirs) != _dtype(mine):
            raise _refused(f"{label} is {_dtype(theirs).name}{list(np.shape(theirs))} in the backup and "
                           f"{_dtype(mine).name}{list(np.shape(mine))} here", field)
        out.append(theirs)
    return jax.tree.unflatten(treedef, out)


def _metric_state(arrays: dict[str, Any], like: Any) -> Any:
    """The saved metric state matched by metric name: a metric new since the backup starts empty,
    one no longer compiled is dropped (both with a warning); positional in older backups."""
    named = _metric_names(like)
    if named is None or any(k.startswith(METRIC_STATE_PREFIX) and k[len(METRIC_STATE_PREFIX):].isdigit()
                            for k in arrays):
        treedef = jax.tree.structure(like)
        return jax.tree.unflatten(treedef, [arrays[f"{METRIC_STATE_PREFIX}{i:05d}"]
                                            for i in range(treedef.num_leaves)])
    saved = {k[len(METRIC_STATE_PREFIX):] for k in arrays if k.startswith(METRIC_STATE_PREFIX)}
    saved_metrics = {k.split("/")[0] for k in saved}
    replicas = next((np.shape(arrays[METRIC_STATE_PREFIX + k])[0] for k in sorted(saved)), None)
    new = sorted({name for name, _ in named} - saved_metrics)
    gone = sorted(saved_metrics - {name for name, _ in named})
    if new or gone:
        warnings.warn(f"the backup's metrics differ from this trainer's: {new or 'none'} new (they start the epoch in "
                      f"progress empty), {gone or 'none'} no longer compiled (their state is dropped).",
                      UserWarning, stacklevel=4)
    out: dict[str, dict[str, Any]] = {}
    for name, f in named:
        key = f"{name}/{f}"
        if name in saved_metrics and key not in saved:
            raise ValueError(f"the backup's state of metric `{name}` has no field {f!r} (it has "
                             f"{sorted(k.split('/', 1)[1] for k in saved if k.split('/')[0] == name)}): the metric "
                             "changed since the backup was taken; resume with the same metrics, or delete the backup.")
        if key in saved:
            value = arrays[METRIC_STATE_PREFIX + key]
        else:  # a new metric: its empty state, on as many replicas as the backup's
            fresh = np.asarray(like[name][f])
            value = np.repeat(fresh[:1], replicas if replicas is not None else fresh.shape[0], axis=0)
        out.setdefault(name, {})[f] = value
    return out


def unflatten_train_state(arrays: dict[str, Any], meta: dict[str, Any], like: TrainState) -> TrainState:
    """The `TrainState` that `flatten_train_state` made `arrays` and `meta` from; `like` (a state of
    the same model, optimizer and metrics) gives the structure of its array trees. Arrays are
    matched to `like`'s by name when both carry `names` (a backup of another process, whose
    Keras layers were numbered otherwise, still fits), else by position.

    Raises:
      ValueError: the optimizer differs, or the weights or the optimizer state do not match
        `like`'s in names, number, shape or dtype (the message names the first difference and
        both values).
    """
    saved_names = None if meta.get("names") is None else StateNames.from_json(meta["names"])
    names = like.names
    if saved_names is not None and names is not None and saved_names.optimizer != names.optimizer:
        raise _refused(f"it was taken with the optimizer `{saved_names.optimizer}`, and this trainer's is "
                       f"`{names.optimizer}`", "opt_state")
    trees = {field: _checked_tree(arrays, field, getattr(like, field),
                                  None if saved_names is None else getattr(saved_names, field),
                                  None if names is None else getattr(names, field))
             for field in ("params", "opt_state")}
    trees["metric_state"] = None if like.metric_state is None else _metric_state(arrays, like.metric_state)
    callbacks = {key: _join_state(cb_state, arrays) for key, cb_state in meta["callbacks"].items()}
    batch_size, data = meta.get("batch_size"), meta.get("data")
    return like.replace(epoch=int(meta["epoch"]), step=int(meta["step"]), global_step=int(meta["global_step"]),
                        data=None if data is None else DataPosition.from_json(data), seed=None if meta["seed"] is None else int(meta["seed"]),
                        batch_size=None if batch_size is None else int(batch_size),
                        accumulation=int(meta.get("accumulation", 1)), callbacks=callbacks, **trees)
