"""Compiled-step factories: small pure functions that `Trainer` wires together.

Each factory returns a function meant for `strategy.run`: it sees one replica's rows of a
distributed batch, and every padding row is masked out by `compute_average_loss` and the
metrics' updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._reduce import ReduceOp
from .._values import get_replica_context
from ..losses import compute_average_loss
from ..metrics import Mean, MetricCollection

Apply = Callable[[Any, Any, bool], tuple[Any, Any, jax.Array]]
LossFn = Callable[[Any, Any], jax.Array]


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a batch given as (x,), (x, y) or (x, y, sample_weight)."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return batch[0], None, None
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            return batch[0], batch[1], batch[2]
    if isinstance(batch, (tuple, list)):
        raise ValueError(f"a batch must be (x,), (x, y) or (x, y, sample_weight), got a sequence of {len(batch)}.")
    return batch, None, None


def _weighted(per_example: jax.Array, sample_weight: Any) -> jax.Array:
    if sample_weight is None:
        return per_example
    w = jnp.asarray(sample_weight, per_example.dtype)
    return per_example * w.reshape(w.shape + (1,) * (per_example.ndim - w.ndim))


def update_logs(loss_tracker: Mean, metrics: MetricCollection, state: dict[str, Any], y: Any, y_pred: Any,
                per_example: jax.Array, sample_weight: Any) -> dict[str, Any]:
    """The epoch's running state after one batch: the loss as Keras reports it (Σ w·loss / samples)
    and every metric; padding rows are masked by the metrics themselves."""
    new = dict(state)
    new["loss"] = loss_tracker.update(state["loss"], _weighted(per_example, sample_weight))
    metric_state = metrics.update({k: state[k] for k in metrics.metrics}, y, y_pred,
                                  sample_weight=sample_weight)
    new.update(metric_state)
    return new


def _agree_non_trainable(values: Any) -> Any:
    """Non-trainable state updated from local data (batch-norm statistics) is averaged over
    replicas (weighted by real samples); integer state (seed counters) is the same everywhere."""
    ctx = get_replica_context()

    def agree(v: jax.Array) -> jax.Array:
        if jnp.issubdtype(v.dtype, jnp.floating):
            return ctx.all_reduce(ReduceOp.MEAN, v)
        return ctx.all_reduce(ReduceOp.MAX, v)
    return jax.tree.map(agree, values)


def make_train_step(apply: Apply, loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    loss_tracker: Mean, metrics: MetricCollection, num_replicas: int) -> Callable[..., Any]:
    """One optimisation step on one replica's rows; gradients come back summed over replicas."""

    def train_step(params: dict[str, Any], opt_state: Any, state: dict[str, Any], batch: Any) -> Any:
        x, y, sw = unpack(batch)

        def objective(trainable: Any) -> tuple[jax.Array, Any]:
            y_pred, non_trainable, extra = apply({"trainable": trainable, "non_trainable": params["non_trainable"]},
                                                 x, True)
            per_example = loss_fn(y, y_pred)
            # a model's own penalties (regularizers) count once per step: 1/R of them on each replica
            loss = compute_average_loss(per_example, sample_weight=sw) + extra / num_replicas
            return loss, (y_pred, per_example, non_trainable)

        (_, (y_pred, per_example, non_trainable)), grads = jax.value_and_grad(objective, has_aux=True)(
            params["trainable"])
        updates, opt_state = optimizer.update(grads, opt_state, params["trainable"])
        trainable = optax.apply_updates(params["trainable"], updates)
        new_params = {"trainable": trainable, "non_trainable": _agree_non_trainable(non_trainable)}
        return new_params, opt_state, update_logs(loss_tracker, metrics, state, y, y_pred, per_example, sw)

    return train_step


def make_eval_step(apply: Apply, loss_fn: LossFn, loss_tracker: Mean, metrics: MetricCollection
                   ) -> Callable[..., Any]:
    """Loss and metrics of one replica's rows, accumulated into the running state."""

    def eval_step(params: dict[str, Any], state: dict[str, Any], batch: Any) -> dict[str, Any]:
        x, y, sw = unpack(batch)
        y_pred, _, _ = apply(params, x, False)
        return update_logs(loss_tracker, metrics, state, y, y_pred, loss_fn(y, y_pred), sw)

    return eval_step


def make_predict_step(apply: Apply) -> Callable[..., Any]:
    """The model's outputs on one replica's rows (padding rows are dropped by `gather`)."""

    def predict_step(params: dict[str, Any], batch: Any) -> Any:
        x, _, _ = unpack(batch)
        return apply(params, x, False)[0]

    return predict_step
