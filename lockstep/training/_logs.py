"""The logs callbacks see: loss and metric values of the per-replica metric state, read as one
compiled reduction of every state (`ended_logs`), and per-batch logs read only when a callback looks
(`LazyLogs`)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, MutableMapping
from typing import Any

import jax
import numpy as np

from ..metrics import MetricCollection


class LazyLogs(MutableMapping[str, Any]):
    """Running logs that are read (one reduction of every state) only when a callback looks.

    In a job of several workers, where a callback reads them (`read`: the same on every worker),
    the reduction is dispatched at once on every worker (a program over all of them, which no
    worker may run alone) and only its transfer to the host waits for a callback to look: a
    callback that reads on one worker alone (the chief's progress bar, a user's ``if is_chief()``)
    neither stalls nor desynchronises the others. A callback may add or copy entries, as in
    Keras' dict of logs."""

    def __init__(self, engine: Any, metrics: MetricCollection, state: Any, read: bool = True):
        self._logs: dict[str, Any] | None = None
        self.state = state  # the per-replica metric state they are of
        self._reduced = _reduced(engine, metrics, state) if read and jax.process_count() > 1 else None
        self._read = functools.partial(_reduced, engine, metrics, state)

    def _values_and_states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self._reduced is None:
            self._reduced = self._read()
        return self._reduced

    def _get(self) -> dict[str, Any]:
        if self._logs is None:
            values, _ = self._values_and_states()
            self._logs = {k: _to_python(v) for k, v in sorted(values.items())}  # Keras' order: by name
        return self._logs

    def in_order(self) -> dict[str, Any]:
        """The loss and metric values in the order of the metrics, the loss first (Keras'
        `get_metrics_result`'s), as reduced (not as a callback may have changed the logs)."""
        return {k: _to_python(v) for k, v in self._values_and_states()[0].items()}

    def states(self) -> dict[str, Any]:
        """The states of the metrics of a fixed size reduced over the replicas, on the host: what
        Keras' metric objects hold after this batch (`ended_logs`); read in the same program as
        the logs."""
        return jax.tree.map(np.asarray, self._values_and_states()[1])

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __setitem__(self, key: str, value: Any) -> None:  # a callback adds to the logs, as to Keras' dict
        self._get()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._get()[key]

    def copy(self) -> dict[str, Any]:
        return dict(self._get())


def _to_python(v: Any) -> Any:
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else a


def _reduced(engine: Any, metrics: MetricCollection, state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Loss and metric values of per-replica `state`, in Keras' order (loss first), and the states
    of its metrics of a fixed size reduced over the replicas (what a Keras metric object holds; not
    the rows a "cat" state keeps), as arrays of this worker: one compiled program reduces them all,
    and each is read to the host only when asked for."""
    values, states = engine.run_to_host(_values_and_states, (metrics, state), ("replicated", "per_replica"))
    return {k: values[k] for k in metrics.metrics}, states


def ended_logs(engine: Any, metrics: MetricCollection, state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The logs of a loop's per-replica `state` (loss and metric values) and the states of its
    metrics of a fixed size (`_reduced`), on the host."""
    values, states = _reduced(engine, metrics, state)
    return {k: _to_python(v) for k, v in values.items()}, jax.tree.map(np.asarray, states)


def _values_and_states(metrics: MetricCollection, state: Any) -> tuple[Any, Any]:
    synced = metrics.sync(state)
    sized = {name: s for name, s in synced.items()
             if all(spec.reduction != "cat" for spec in metrics.metrics[name].state_specs.values())}
    return metrics.result_from(synced), sized
