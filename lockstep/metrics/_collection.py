"""`MetricCollection`: many metrics, one state, one reduction across replicas per read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax

from .._errors import UsageError
from ..engine import get_replica_context
from ._base import Metric, State, StateSpec, compute_per_replica, per_replica_engine, sync_in_replica, synced_result
from ._registry import get as get_metric


class MetricCollection:
    """Several metrics updated together and read with one reduction of all their states.

    Reading a collection reduces the states of *all* its metrics in one step (inside `run`:
    one all-reduce per kind of reduction; outside: one compiled program), instead of one
    collective per metric.

    >>> import lockstep as ls, numpy as np
    >>> c = ls.metrics.MetricCollection(["accuracy", ls.metrics.F1Score(average="macro")])
    >>> c.update_state(np.array([0, 1, 1]), np.array([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]]))
    >>> {k: round(float(v), 4) for k, v in c.result().items()}
    {'accuracy': 0.6667, 'f1_score': 0.6667}
    """

    def __init__(self, metrics: Iterable[Metric | str] | Mapping[str, Metric | str]):
        items = list(metrics.items()) if isinstance(metrics, Mapping) else [(None, m) for m in metrics]
        self.metrics: dict[str, Metric] = {}
        for key, m in items:
            metric = get_metric(m)
            name = key or metric.name
            base, i = name, 1
            while name in self.metrics:
                name = f"{base}_{i}"
                i += 1
            self.metrics[name] = metric
        self._state: dict[str, State] | None = None
        self._jit_update = jax.jit(self.update)
        self._jit_compute = jax.jit(self.compute)

    def build(self, y_true_shape: tuple[int, ...], y_pred_shape: tuple[int, ...]) -> None:
        for m in self.metrics.values():
            if not m.built:
                m.build(y_true_shape, y_pred_shape)

    @property
    def built(self) -> bool:
        return all(m.built for m in self.metrics.values())

    def _specs(self) -> dict[str, StateSpec]:
        return {f"{name}/{k}": spec for name, m in self.metrics.items() for k, spec in m.state_specs.items()}

    def init(self) -> dict[str, State]:
        return {name: m.init() for name, m in self.metrics.items()}

    def update(self, state: dict[str, State], y_true: Any, y_pred: Any, sample_weight: Any = None,
               mask: Any = None) -> dict[str, State]:
        """Every metric's state updated with one batch (`mask`: see `Metric.update`)."""
        return {name: m.update(state[name], y_true, y_pred, sample_weight=None if m.weighted is False else sample_weight,
                               mask=mask)
                for name, m in self.metrics.items()}

    def merge(self, a: dict[str, State], b: dict[str, State]) -> dict[str, State]:
        return {name: m.merge(a[name], b[name]) for name, m in self.metrics.items()}

    def sync(self, state: dict[str, State]) -> dict[str, State]:
        """Inside `strategy.run`: all states of all metrics reduced across replicas together."""
        flat = {f"{name}/{k}": v for name, s in state.items() for k, v in s.items()}
        synced = sync_in_replica(flat, self._specs())
        return {name: {k: synced[f"{name}/{k}"] for k in m.state_specs} for name, m in self.metrics.items()}

    def result_from(self, state: dict[str, State]) -> dict[str, Any]:
        """Every metric's value from global (already reduced) state."""
        return {name: m.result_from(state[name]) for name, m in self.metrics.items()}

    def compute(self, state: dict[str, State]) -> dict[str, Any]:
        """Every metric's value; on per-replica state, one compiled program reduces and computes all."""
        engine = per_replica_engine(state)
        if engine is not None:
            return compute_per_replica(engine, self, state)
        if get_replica_context() is not None:
            return synced_result(self, state)
        return self.result_from(state)

    # eager face
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        if get_replica_context() is not None:
            raise UsageError("`MetricCollection.update_state` is eager; inside `strategy.run` use "
                             "`state = collection.update(state, ...)`.")
        y_true, y_pred = jax.numpy.asarray(y_true), jax.numpy.asarray(y_pred)
        for m in self.metrics.values():
            m.check_inputs(y_true, y_pred)
        self.build(y_true.shape, y_pred.shape)
        if self._state is None:
            self._state = self.init()
        self._state = self._jit_update(self._state, y_true, y_pred, sample_weight)

    def result(self) -> dict[str, Any]:
        if self._state is None:
            return {name: m.result() for name, m in self.metrics.items()}
        return self._jit_compute(self._state)

    def reset_state(self) -> None:
        self._state = None
