"""A model with several outputs, as Keras' `compile` describes it: a loss per output (scaled by
`loss_weights`), metrics per output, labels and sample weights per output, logged under Keras'
names (``loss``, ``<output>_loss`` for each output with a loss, ``<output>_<metric>``).

Labels and sample weights are taken as Keras takes them: a dict keyed by output name or a list in
the model's output order; one array of sample weights serves every output. Inside a step they are
matched to the outputs by name. Each output's loss is Keras' ``"sum_over_batch_size"``: its
per-sample losses times the sample weights, averaged over the real samples (and over any further
axes), so the step's loss is the one-device loss on any number of replicas.

>>> import numpy as np
>>> outputs = Outputs(["cls", "reg"])
>>> sorted(outputs.named([np.zeros(2), np.ones(2)], "y"))
['cls', 'reg']
>>> losses = OutputLosses(outputs, {"reg": "mse"}, {"reg": 0.5})
>>> float(losses({"reg": np.array([1.0, 3.0])}, [np.zeros((2, 3)), np.array([0.0, 1.0])]).sum())
2.5
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import losses as _losses
from ..metrics import Metric, divide_no_nan
from ..metrics import get as get_metric

State = dict[str, Any]  # a metric's state


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def shapes_of(y: Any) -> Any:
    """The shape of labels `y`, or a tree of shapes for labels of several outputs (a dict or list of arrays).

    >>> import numpy as np
    >>> shapes_of([np.zeros((4, 1)), np.zeros(4)]), shapes_of([1, 2, 3])
    ([(4, 1), (4,)], (3,))
    """
    if isinstance(y, (Mapping, list, tuple)) and all(hasattr(v, "shape") for v in jax.tree.leaves(y)):
        return jax.tree.map(lambda a: tuple(a.shape), y)
    return tuple(jnp.shape(y))


class Outputs:
    """The model's output names in its order, and the matching of Keras-style structures to them."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)

    def named(self, tree: Any, arg: str, shared: bool = False) -> dict[str, Any]:
        """`tree` (a dict by output name, a list in output order, or, for one output or when
        `shared`, one array for all) as a dict by output name.

        Raises:
          ValueError: names that are not outputs, or a list of another length; the message names `arg`.
        """
        if isinstance(tree, Mapping):
            unknown = sorted(set(tree) - set(self.names))
            if unknown:
                raise ValueError(f"`{arg}` is keyed by {unknown}, which are not outputs of the model; its outputs are "
                                 f"{self.names}.")
            return dict(tree)
        if isinstance(tree, (list, tuple)) and not _is_shape(tree):
            if len(tree) != len(self.names):
                raise ValueError(f"`{arg}` holds {len(tree)} entries but the model has {len(self.names)} outputs "
                                 f"{self.names}: give one per output, in that order, or a dict keyed by output name.")
            return dict(zip(self.names, tree))
        if shared or len(self.names) == 1:
            return {name: tree for name in self.names}
        raise ValueError(f"`{arg}` is one array but the model has {len(self.names)} outputs {self.names}: give a dict "
                         "keyed by output name, or a list in output order.")


def loss_weight(weight: Any, output: str | None = None) -> float:
    """An entry of `loss_weights` checked: a number.

    >>> loss_weight(0.5)
    0.5
    """
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        where = "" if output is None else f" for output {output!r}"
        raise ValueError(f"`loss_weights` must hold numbers, got {weight!r}{where}.")
    return float(weight)


def _per_entry(spec: Any, outputs: Outputs, arg: str) -> dict[str, Any]:
    """A `compile` argument given per output (a dict by name, or a list in output order), as a dict."""
    if isinstance(spec, Mapping):
        return outputs.named(spec, arg)
    if isinstance(spec, (list, tuple)) and len(spec) == len(outputs.names):
        return dict(zip(outputs.names, spec))
    raise ValueError(f"`{arg}` must be given per output for a model with outputs {outputs.names}: a dict keyed by "
                     f"output name, or a list with one entry per output; got {spec!r}.")


class OutputLosses:
    """The total per-sample loss of a model with several outputs: Σ weight · loss of each output.

    Called as ``losses(y, y_pred, sample_weight)``: it applies the sample weights itself (per
    output), so the step passes them here and not to the average.

    Args:
      outputs: the model's outputs.
      losses: the loss of each output that has one (a name, a Keras loss or a per-sample
        function); one loss for all outputs when not a dict or list.
      loss_weights: each output's weight (a dict or list; default 1).
    """

    takes_sample_weight = True

    def __init__(self, outputs: Outputs, losses: Any, loss_weights: Any = None):
        self.outputs = outputs
        if isinstance(losses, (Mapping, list, tuple)):
            given = _per_entry(losses, outputs, "loss")
        else:
            given = {name: losses for name in outputs.names}
        self.losses = {name: _losses.get(loss) for name, loss in given.items() if loss is not None}
        if not self.losses:
            raise ValueError("`loss` gives no output a loss.")
        weights = {} if loss_weights is None else _per_entry(loss_weights, outputs, "loss_weights")
        checked = {name: loss_weight(w, name) for name, w in weights.items()}
        self.weights = {name: checked.get(name, 1.0) for name in self.losses}

    def per_output(self, y: Any, y_pred: Any, sample_weight: Any = None,
                   only: str | None = None) -> dict[str, jax.Array]:
        """Each output's (or the output `only`'s) per-sample loss, times its sample weights (shape ``(batch,)``)."""
        y_true = self.outputs.named(y, "y")
        pred = self.outputs.named(y_pred, "the model's outputs")
        weights = {} if sample_weight is None else self.outputs.named(sample_weight, "sample_weight", shared=True)
        out = {}
        for name, fn in self.losses.items():
            if only is not None and name != only:
                continue
            if name not in y_true:
                raise ValueError(f"`y` has no labels for output {name!r}, which has a loss; it has {sorted(y_true)}.")
            value = jnp.asarray(_losses.weighted_per_sample(fn, y_true[name], pred[name], weights.get(name),
                                                            f"output {name!r}", jnp.float32), jnp.float32)
            out[name] = value if value.ndim <= 1 else jnp.mean(value.reshape(value.shape[0], -1), axis=-1)
        return out

    def __call__(self, y: Any, y_pred: Any, sample_weight: Any = None) -> jax.Array:
        parts = self.per_output(y, y_pred, sample_weight)
        return sum((self.weights[name] * v for name, v in parts.items()), jnp.zeros(()))


class OutputLoss(Metric):
    """``<output>_loss``: one output's loss as Keras logs it (its weighted per-sample losses over the
    samples seen, before `loss_weights`)."""

    direction = "down"
    weighted = True

    def __init__(self, losses: OutputLosses, output: str):
        super().__init__(name=f"{output}_loss")
        self._losses, self._output = losses, output
        self.add_state("total")
        self.add_state("count")

    def update(self, state: State, y_true: Any, y_pred: Any, sample_weight: Any = None, mask: Any = None) -> State:
        value = self._losses.per_output(y_true, y_pred, sample_weight, only=self._output)[self._output]
        m = jnp.ones(value.shape[:1], value.dtype) if mask is None else jnp.asarray(mask, value.dtype)
        return self.merge(state, {"total": jnp.sum(jnp.where(m > 0, value, 0.0)), "count": jnp.sum(m)})

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        return self.update({}, y_true, y_pred, sample_weight)

    def result_from(self, state: State) -> Any:
        return divide_no_nan(state["total"], state["count"])


class OutputMetric(Metric):
    """A metric of one output, logged as Keras names it: ``<output>_<metric>``."""

    def __init__(self, outputs: Outputs, output: str, metric: Any, weighted: bool | None):
        inner = get_metric(metric)
        super().__init__(name=f"{output}_{inner.name}")
        self.inner, self._outputs, self._output = inner, outputs, output
        self.direction, self.weighted = inner.direction, weighted

    def _pick(self, tree: Any, arg: str) -> Any:
        return self._outputs.named(tree, arg, shared=arg == "sample_weight")[self._output]

    @property
    def built(self) -> bool:
        return self.inner.built

    def build(self, y_true_shape: Any, y_pred_shape: Any) -> None:
        self.inner.build(self._pick(y_true_shape, "y"), self._pick(y_pred_shape, "the model's outputs"))

    @property
    def state_specs(self) -> dict[str, Any]:
        return self.inner.state_specs

    def init(self) -> State:
        return self.inner.init()

    def update(self, state: State, y_true: Any, y_pred: Any, sample_weight: Any = None, mask: Any = None) -> State:
        y = self._outputs.named(y_true, "y")
        if self._output not in y:
            raise ValueError(f"`y` has no labels for output {self._output!r}, which has metrics; it has {sorted(y)}.")
        sw = None if sample_weight is None else self._pick(sample_weight, "sample_weight")
        return self.inner.update(state, y[self._output], self._pick(y_pred, "the model's outputs"), sample_weight=sw,
                                 mask=mask)

    def batch_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> State:
        return self.update(self.init(), y_true, y_pred, sample_weight)

    def merge(self, a: State, b: State) -> State:
        return self.inner.merge(a, b)

    def sync(self, state: State) -> State:
        return self.inner.sync(state)

    def result_from(self, state: State) -> Any:
        return self.inner.result_from(state)


def keras_metric_names(entries: Iterable[tuple[str, str, bool]]) -> list[str]:
    """The names Keras' compiled metrics log, from (output prefix, metric name, weighted) in Keras'
    order (every output's `metrics` before the `weighted_metrics`): a repeated name gets ``_1``,
    ``_2``…, a weighted metric named as an earlier one ``<prefix>weighted_<name>`` (Keras'
    `CompileMetrics.result`).

    >>> keras_metric_names([("", "mae", False), ("", "mae", False), ("", "mae", True), ("a_", "mae", True)])
    ['mae', 'mae_1', 'weighted_mae', 'a_mae']
    """
    counts: dict[str, int] = {}
    out = []
    for prefix, name, weighted in entries:
        full = prefix + name
        if full in counts and weighted:
            full = f"{prefix}weighted_{name}"
        if full in counts:
            counts[full] += 1
            full = f"{full}_{counts[full] - 1}"
        else:
            counts[full] = 1
        out.append(full)
    return out


def metrics_per_output(outputs: Outputs, groups: Sequence[tuple[Any, bool | None]]) -> list[Metric]:
    """`OutputMetric`s from `compile`'s ``metrics`` and ``weighted_metrics`` (each a dict by output
    name or a list with one entry per output; an entry is a metric or a list of them), paired with
    whether the group is weighted by `sample_weight`; named as Keras names them (`keras_metric_names`)."""
    out: list[OutputMetric] = []
    for spec, weighted in groups:
        if not spec:
            continue
        for name, entry in _per_entry(spec, outputs, "metrics").items():
            for metric in entry if isinstance(entry, (list, tuple)) else [entry]:
                if metric is not None:
                    out.append(OutputMetric(outputs, name, metric, weighted))
    for metric, name in zip(out, keras_metric_names((f"{m._output}_", m.inner.name, m.weighted is True) for m in out)):
        metric.name = name
    return list(out)


def settings(outputs: Outputs, loss: Any, loss_weights: Any, groups: Sequence[tuple[Any, bool | None]]
             ) -> tuple[OutputLosses, list[Metric]]:
    """(the total loss, the logged metrics: each output's loss when more than one has a loss, as
    Keras logs them, then the metrics per output)."""
    losses = OutputLosses(outputs, loss, loss_weights)
    trackers: list[Metric] = [OutputLoss(losses, name) for name in losses.losses] if len(losses.losses) > 1 else []
    metrics = sorted(metrics_per_output(outputs, groups), key=lambda m: m.name)  # Keras lists them by name
    return losses, trackers + metrics
