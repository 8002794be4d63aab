"""`Metric`: metric state as a pytree whose fields declare their cross-replica reduction.

The whole evaluation loop, functional face (usable inside `strategy.run` and `jit`):

>>> import lockstep as ls, numpy as np
>>> s = ls.MirroredStrategy(3)
>>> m = ls.metrics.Mean()
>>> state = m.init()
>>> for batch in s.experimental_distribute_dataset(ls.data.batches(np.arange(7.0), 4)):
...     state = s.run(m.update, args=(state, batch))     # the mask is applied by itself
>>> float(m.compute(state))                              # state reduced across replicas, then computed
3.0

The eager face, with Keras' names, on the same implementation:

>>> m.update_state([1.0, 2.0]); m.update_state([6.0])
>>> float(m.result())
3.0
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import UsageError
from ..distribute import Mirrored, PerReplica, engine_of, unwrap
from ..engine import all_gather, along_rows, get_replica_context, highest, lowest

REDUCTIONS = ("sum", "max", "min", "cat")

State = dict[str, Any]


class StateSpec(NamedTuple):
    """One field of a metric's state."""

    shape: tuple[int, ...]   # per-replica shape (for "cat": the shape of one row)
    dtype: Any               # e.g. float32
    reduction: str           # "sum" | "max" | "min" | "cat": how replicas and batches combine
    fill: Any                # the empty value: 0 for sum, -inf for max, +inf for min


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _combine(a: jax.Array, b: jax.Array, reduction: str) -> jax.Array:
    if reduction == "sum":
        return a + b
    if reduction == "max":
        return jnp.maximum(a, b)
    if reduction == "min":
        return jnp.minimum(a, b)
    return jnp.concatenate([a, b], axis=0)


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def sync_in_replica(state: State, specs: Mapping[str, StateSpec], arg: str = "state") -> State:
    """Reduces metric state across replicas, inside a replica (`strategy.run`): one all-reduce per
    kind of reduction with every field of that kind together; `cat` fields are all-gathered."""
    if set(state) != set(specs):
        raise ValueError(f"`{arg}` must have the fields {sorted(specs)}, got {sorted(state)}.")
    ctx = get_replica_context()
    if ctx is None:
        raise UsageError("metric state is synced across replicas inside `strategy.run`; outside it, "
                         "read per-replica state with `compute` (or `MetricCollection.compute`).")
    out = dict(state)
    for reduction, collective in (("sum", jax.lax.psum), ("max", jax.lax.pmax), ("min", jax.lax.pmin)):
        names = [k for k in state if specs[k].reduction == reduction]
        if names:
            reduced = collective([state[k] for k in names], ctx.axis_name)
            out.update(zip(names, reduced))
    for k in (k for k in state if specs[k].reduction == "cat"):
        out[k] = all_gather(state[k], 0, ctx.axis_name)
    return out


def per_replica_engine(state: Any) -> Any:
    """The engine (a strategy's ``extended``) of the `PerReplica` leaves of `state`, outside `run`;
    None otherwise."""
    if get_replica_context() is not None:
        return None
    found = {engine_of(v) for v in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, PerReplica))
             if isinstance(v, PerReplica)}
    if len(found) > 1:
        raise ValueError("`state` mixes per-replica values of several strategies.")
    return found.pop() if found else None


def synced_result(metric: Any, state: Any) -> Any:
    """Inside a replica: `metric`'s value from its per-replica `state` (sync, then `result_from`).
    `metric` is a `Metric` or a `MetricCollection`."""
    return metric.result_from(metric.sync(state))


def compute_per_replica(engine: Any, metric: Any, state: Any) -> Any:
    """`synced_result` of `PerReplica` state, as one compiled program on `engine`; plain arrays back
    (a per-replica output is identical on every replica: an all-gather)."""
    distributed = lambda v: isinstance(v, (PerReplica, Mirrored))  # noqa: E731
    kinds = jax.tree.map(lambda v: "per_replica" if isinstance(v, PerReplica) else "replicated", state,
                         is_leaf=distributed)
    return engine.run_to_host(synced_result, (metric, unwrap(state)), ("replicated", kinds))


class Metric:
    """Base class of lockstep metrics: declared state, functional and eager faces.

    A subclass declares its state fields with `add_state` (each with its reduction across
    replicas and batches), computes one batch's contribution in `batch_state`, and turns the
    total into a value in `result_from`. `merge` is element-wise (sum / max / min) or a
    concatenation, so it is associative, and the reduced state of any split of the data is the
    state of the whole data.

    A custom metric in a few lines — the "custom metric with an explicit reduction" of the
    user stories: the fraction of samples whose error is under a tolerance, exact on any
    number of replicas because it reduces *counts*, never per-replica fractions:

    >>> import jax.numpy as jnp, lockstep as ls
    >>> class WithinTolerance(ls.metrics.Metric):
    ...     def __init__(self, tol=0.5, name=None):
    ...         super().__init__(name=name)
    ...         self.tol = tol
    ...         self.add_state("hits", reduction="sum")
    ...         self.add_state("count", reduction="sum")
    ...     def batch_state(self, y_true, y_pred, sample_weight=None):
    ...         w = jnp.ones(jnp.shape(y_true)) if sample_weight is None else sample_weight
    ...         hit = (jnp.abs(jnp.asarray(y_true) - jnp.asarray(y_pred)) < self.tol)
    ...         return {"hits": jnp.sum(w * hit), "count": jnp.sum(w)}
    ...     def result_from(self, state):
    ...         return ls.metrics.divide_no_nan(state["hits"], state["count"])
    >>> m = WithinTolerance()
    >>> m.update_state([1.0, 2.0, 3.0], [1.2, 2.9, 3.1])
    >>> round(float(m.result()), 4)
    0.6667
    """

    #: "up" when larger is better, "down" when smaller is; callbacks with mode="auto" read it.
    direction: str | None = None
    #: whether `fit` / `evaluate` weigh it by `sample_weight`: None, lockstep's default (weighted);
    #: False for the `metrics` of a Keras `compile` and True for its `weighted_metrics`, as Keras does.
    weighted: bool | None = None

    def __init__(self, name: str | None = None, dtype: Any = "float32"):
        self.name = name or _snake(type(self).__name__)
        self.dtype = jnp.dtype(dtype)
        self._specs: dict[str, StateSpec] = {}
        self._state: State | None = None
        self._jit_update = jax.jit(self._update_impl)
        self._jit_compute = jax.jit(self.compute)

    # --- declaring state -----------------------------------------------------------------
    def add_state(self, name: str, shape: tuple[int, ...] = (), reduction: str = "sum",
                  dtype: Any = None, fill: Any = None) -> None:
        """Declares a state field and how it combines across batches and replicas.

        Args:
          name: field name.
          shape: the field's shape (for ``"cat"``, the shape of one row).
          reduction: ``"sum"``, ``"max"``, ``"min"`` or ``"cat"`` (rows concatenated).
          dtype: defaults to the metric's dtype.
          fill: the empty value; defaults to the reduction's identity.
        """
        if reduction not in REDUCTIONS:
            raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got reduction={reduction!r}.")
        dtype = jnp.dtype(dtype or self.dtype)
        if fill is None:
            fill = {"sum": 0, "max": lowest(dtype), "min": highest(dtype), "cat": 0}[reduction]
        self._specs[name] = StateSpec(tuple(int(d) for d in shape), dtype, reduction, fill)

    @property
    def state_specs(self) -> dict[str, StateSpec]:
        """The declared state fields (name → shape, dtype, reduction)."""
        self._ensure_built()
        return dict(self._specs)

    # --- lazily shaped metrics -------------------------------------------------------------
    @property
    def built(self) -> bool:
        return True

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        """Fixes state shapes that depend on the data (say, the number of classes)."""

    def _ensure_built(self) -> None:
        if not self.built:
            raise UsageError(
                f"{type(self).__name__} `{self.name}` does not know its state's shape yet: pass "
                "`num_classes=` (or `num_labels=`) to the constructor, or call "
                "`build(y_true_shape, y_pred_shape)` before `init()`."
            )

    # --- functional face -------------------------------------------------------------------
    def init(self) -> State:
        """The empty state: a dict of arrays. A metric whose state's shape depends on the data
        (`F1Score` without `num_classes`) returns ``{}``, which its first `update` shapes — also
        inside `strategy.run` — as Keras builds metrics lazily.

        >>> import lockstep as ls, numpy as np
        >>> f1 = ls.metrics.F1Score(average="macro")
        >>> state = f1.update(f1.init(), np.array([0, 1, 2]), np.eye(3)[[0, 1, 1]])
        >>> round(float(f1.compute(state)), 4)
        0.5556
        """
        if not self.built:
            return {}
        out = {}
        for k, spec in self._specs.items():
            shape = (0, *spec.shape) if spec.reduction == "cat" else spec.shape
            out[k] = jnp.full(shape, spec.fill, spec.dtype)
        return out

    def batch_state(self, *args: Any, sample_weight: Any = None) -> State:
        """One batch's contribution to the state. `sample_weight` already includes the mask."""
        raise NotImplementedError

    def result_from(self, state: State) -> Any:
        """The metric's value from a global (already reduced) state."""
        raise NotImplementedError

    def update(self, state: State, *args: Any, sample_weight: Any = None, mask: Any = None) -> State:
        """`state` updated with one batch; rows where `mask` is 0 do not count.

        `mask` defaults to the replica's padding mask inside `strategy.run` (so a custom loop's
        padding rows are masked out by themselves), and to no mask outside.
        """
        if not self.built:
            self.build(*(jnp.shape(a) for a in args[:2]))
        if mask is None:
            ctx = get_replica_context()
            mask = None if ctx is None else ctx.mask
        weight = _effective_weight(args, sample_weight, mask)
        return self.merge(state, self.batch_state(*args, sample_weight=weight))

    def merge(self, a: State, b: State) -> State:
        """Combines two states (associative and commutative, up to the order of `cat` rows); the
        unshaped empty state ``{}`` is the identity."""
        if not a or not b:
            return b if not a else a
        return {k: _combine(a[k], b[k], self._specs[k].reduction) for k in self._specs}

    def sync(self, state: State) -> State:
        """Per-replica `state` reduced across replicas with each field's declared reduction
        (inside `strategy.run`: one all-reduce per kind of reduction)."""
        return sync_in_replica(state, self._specs)

    def compute(self, state: State) -> Any:
        """The value of `state`: per-replica state is reduced across replicas, then computed.

        Inside `run`: `result_from(sync(state))`. Outside, on the `PerReplica` state that `run`
        returned, the same runs as one compiled program on the state's strategy (the value is the
        same on every worker); plain arrays are taken as global state already.
        """
        if isinstance(state, Mapping) and not state and (self._specs or not self.built):  # nothing seen yet
            return jnp.asarray(0.0, self.dtype)
        engine = per_replica_engine(state)
        if engine is not None:
            return compute_per_replica(engine, self, state)
        if get_replica_context() is not None:
            return synced_result(self, state)
        return self.result_from(state)

    # --- eager face (Keras names) ----------------------------------------------------------
    def _update_impl(self, state: State, args: tuple[Any, ...], sample_weight: Any) -> State:
        return self.update(state, *args, sample_weight=sample_weight)

    def update_state(self, *args: Any, sample_weight: Any = None) -> None:
        """Accumulates one batch into this object's state (eager; not inside `strategy.run`)."""
        if get_replica_context() is not None:
            raise UsageError(
                f"`{self.name}.update_state` is the eager face and cannot run inside `strategy.run`: "
                f"use the functional face there, `state = {self.name}.update(state, ...)`."
            )
        args = tuple(jnp.asarray(a) for a in args)
        self.check_inputs(*args)
        if not self.built:
            self.build(*(a.shape for a in args[:2]))
        if self._state is None:
            self._state = self.init()
        sw = None if sample_weight is None else jnp.asarray(sample_weight)
        self._state = self._jit_update(self._state, args, sw)

    def result(self) -> Any:
        """The value over everything seen since the last reset (0 before any update, as in Keras)."""
        if self._state is None:
            if not self.built:
                return jnp.asarray(0.0, self.dtype)
            self._state = self.init()
        return self._jit_compute(self._state)

    def reset_state(self) -> None:
        """Forgets everything seen."""
        self._state = None

    def check_inputs(self, *args: Any) -> None:
        """Checks concrete (eager) inputs; subclasses add value checks (say, label ranges)."""

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": str(self.dtype)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _effective_weight(args: tuple[Any, ...], sample_weight: Any, mask: Any) -> jax.Array | None:
    """`sample_weight` times the per-sample `mask` (padding rows: 0), checked against the batch."""
    n = None
    shapes = [jnp.shape(a) for a in args[:2]]
    if len(shapes) == 2 and shapes[0][:1] and shapes[1][:1] and shapes[0][0] != shapes[1][0]:
        raise ValueError(f"`y_true` and `y_pred` must have the same number of samples, got shapes "
                         f"{shapes[0]} and {shapes[1]}.")
    if shapes and shapes[0]:
        n = shapes[0][0]
    w = None if sample_weight is None else jnp.asarray(sample_weight, jnp.float32)
    if w is not None and n is not None and w.ndim and w.shape[0] != n:
        raise ValueError(f"`sample_weight` must have one entry per sample ({n}), got shape {w.shape}.")
    if mask is None:
        return w
    if n is not None and n != mask.shape[0]:
        raise ValueError(
            f"a metric update takes one row per entry of the mask (inside `strategy.run`: this replica's "
            f"rows of the distributed batch, {mask.shape[0]}), got {n} rows."
        )
    if w is None:
        return mask
    return w * along_rows(mask, max(w.ndim, 1))


def divide_no_nan(a: Any, b: Any) -> jax.Array:
    """`a / b`, and 0 where `b` is 0 (the value Keras reports before any data)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    safe = jnp.where(b == 0, jnp.ones_like(b), b)
    return jnp.where(b == 0, jnp.zeros_like(a / safe), a / safe)


def same_rank(y_true: Any, y_pred: Any, dtype: Any = None) -> tuple[jax.Array, jax.Array]:
    """`y_true` and `y_pred` with a trailing axis of size 1 squeezed from the one of higher rank."""
    y_true = jnp.asarray(y_true) if dtype is None else jnp.asarray(y_true, dtype)
    y_pred = jnp.asarray(y_pred) if dtype is None else jnp.asarray(y_pred, dtype)
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        y_true = y_true[..., 0]
    elif y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred[..., 0]
    return y_true, y_pred


def expand_weight(weight: jax.Array | None, like: jax.Array) -> jax.Array:
    """Per-sample weights broadcast to `like`'s shape (ones when `weight` is None)."""
    if weight is None:
        return jnp.ones(like.shape, jnp.float32)
    weight = jnp.asarray(weight, jnp.float32)
    return jnp.broadcast_to(along_rows(weight, max(like.ndim, weight.ndim)), like.shape)


def check_labels(labels: Any, num_classes: int, arg: str = "y_true") -> None:
    """Raises ValueError when concrete integer labels fall outside [0, num_classes)."""
    if not _is_concrete(labels):
        return
    arr = np.asarray(labels)
    if arr.size and (arr.min() < 0 or arr.max() >= num_classes):
        raise ValueError(
            f"`{arg}` holds labels outside [0, {num_classes}): got min {arr.min()}, max {arr.max()}."
        )
