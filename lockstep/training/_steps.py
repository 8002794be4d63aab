"""Compiled-step factories: small pure functions that `Trainer` wires together.

Each factory returns a function of plain arrays for `strategy.extended.run_arrays`: it sees
one replica's rows of a distributed batch (`data`), their mask (1.0 real, 0.0 padding) and the
step's real sample count, and passes both explicitly to the loss and the metrics, so padding
rows never count.

The steps run with `shard_map`'s replication typing off (`CHECK_VMA = False`): a `lax.scan`
whose carry starts replicated (zeros) and becomes per-replica — every Keras recurrent layer —
then traces on any number of replicas. The price is that JAX no longer sums the gradients of
replicated parameters over replicas by itself, so the train step sums them (one `psum`, the same
collective as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._cross_replica import AXIS, all_reduce
from .._reduce import ReduceOp
from ..losses import masked_average_loss
from ..metrics import Mean, MetricCollection

Apply = Callable[[Any, Any, bool], tuple[Any, Any, jax.Array | None]]
LossFn = Callable[[Any, Any], jax.Array]

#: Steps are traced without replication typing (see the module docstring).
CHECK_VMA = False

#: The kinds of the steps' arguments and results (see `lockstep._run`).
TRAIN_KINDS = ("replicated", "replicated", "per_replica", "rows", "rows", "replicated")
TRAIN_OUT = ("replicated", "replicated", "per_replica")
EVAL_KINDS = ("replicated", "per_replica", "rows", "rows", "replicated")
PREDICT_KINDS = ("replicated", "rows")


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a batch given as (x,), (x, y) or (x, y, sample_weight)."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 1:
            return batch[0], None, None
        if len(batch) == 2:
            return batch[0], batch[1], None
        if len(batch) == 3:
            return batch[0], batch[1], batch[2]
        raise ValueError(f"a batch must be (x,), (x, y) or (x, y, sample_weight), got a sequence of {len(batch)}.")
    return batch, None, None


def _weighted(per_example: jax.Array, sample_weight: Any) -> jax.Array:
    if sample_weight is None:
        return per_example
    w = jnp.asarray(sample_weight, per_example.dtype)
    return per_example * w.reshape(w.shape + (1,) * (per_example.ndim - w.ndim))


def global_penalty(penalty: jax.Array | None, num_replicas: int) -> jax.Array | None:
    """The step's whole penalty (regularisers, `add_loss`) from each replica's: every replica
    contributes ``penalty / num_replicas`` (see `_model`), so the sum counts it once."""
    return None if penalty is None else jax.lax.psum(penalty / num_replicas, AXIS)


def update_logs(loss_tracker: Mean, metrics: MetricCollection, state: dict[str, Any], y: Any, y_pred: Any,
                per_example: jax.Array, sample_weight: Any, mask: jax.Array,
                penalty: jax.Array | None = None) -> dict[str, Any]:
    """The epoch's running state after one batch: the loss as Keras reports it (Σ w·loss / samples,
    plus the step's penalty, which Keras adds to every batch's loss) and every metric, over the
    real rows (`mask`)."""
    new = dict(state)
    logged = _weighted(per_example, sample_weight)
    if penalty is not None:
        logged = logged + penalty.astype(logged.dtype)
    new["loss"] = loss_tracker.update(state["loss"], logged, mask=mask)
    new.update(metrics.update({k: state[k] for k in metrics.metrics}, y, y_pred, sample_weight=sample_weight,
                              mask=mask))
    return new


def _agree_non_trainable(values: Any, mask: jax.Array) -> Any:
    """Non-trainable state updated from local data (batch-norm statistics) is averaged over
    replicas (weighted by real samples); integer state (seed counters) is the same everywhere."""
    local = jnp.sum(mask)

    def agree(v: jax.Array) -> jax.Array:
        op = ReduceOp.MEAN if jnp.issubdtype(v.dtype, jnp.floating) else ReduceOp.MAX
        return all_reduce(op, v, local)
    return jax.tree.map(agree, values)


def make_train_step(apply: Apply, loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    loss_tracker: Mean, metrics: MetricCollection, num_replicas: int) -> Callable[..., Any]:
    """One optimisation step on one replica's rows, with the gradient summed over replicas."""

    def train_step(params: dict[str, Any], opt_state: Any, state: dict[str, Any], data: Any, mask: jax.Array,
                   count: jax.Array) -> Any:
        x, y, sw = unpack(data)

        def objective(trainable: Any) -> tuple[jax.Array, Any]:
            y_pred, non_trainable, penalty = apply({"trainable": trainable, "non_trainable": params["non_trainable"]},
                                                   x, True)
            per_example = loss_fn(y, y_pred)
            loss = masked_average_loss(per_example, mask, count, sample_weight=sw)
            if penalty is not None:  # a model's own penalties count once per step: 1/R on each replica
                loss = loss + penalty / num_replicas
            return loss, (y_pred, per_example, non_trainable, penalty)

        (_, (y_pred, per_example, non_trainable, penalty)), grads = jax.value_and_grad(objective, has_aux=True)(
            params["trainable"])
        grads = jax.lax.psum(grads, AXIS)  # this replica's share -> the global gradient (CHECK_VMA off)
        updates, opt_state = optimizer.update(grads, opt_state, params["trainable"])
        trainable = optax.apply_updates(params["trainable"], updates)
        new_params = {"trainable": trainable, "non_trainable": _agree_non_trainable(non_trainable, mask)}
        logs = update_logs(loss_tracker, metrics, state, y, y_pred, per_example, sw, mask,
                           global_penalty(penalty, num_replicas))
        return new_params, opt_state, logs

    return train_step


def make_eval_step(apply: Apply, loss_fn: LossFn, loss_tracker: Mean, metrics: MetricCollection,
                   num_replicas: int) -> Callable[..., Any]:
    """Loss and metrics of one replica's rows, accumulated into the running state."""

    def eval_step(params: dict[str, Any], state: dict[str, Any], data: Any, mask: jax.Array,
                  count: jax.Array) -> dict[str, Any]:
        x, y, sw = unpack(data)
        y_pred, _, penalty = apply(params, x, False)
        return update_logs(loss_tracker, metrics, state, y, y_pred, loss_fn(y, y_pred), sw, mask,
                           global_penalty(penalty, num_replicas))

    return eval_step


def make_predict_step(apply: Apply) -> Callable[..., Any]:
    """The model's outputs on one replica's rows (padding rows are dropped afterwards)."""

    def predict_step(params: dict[str, Any], data: Any) -> Any:
        x, _, _ = unpack(data)
        return apply(params, x, False)[0]

    return predict_step


def make_steps(apply: Apply, loss_fn: LossFn, optimizer: optax.GradientTransformation, loss_tracker: Mean,
               metrics: MetricCollection, num_replicas: int) -> dict[str, Callable[..., Any]]:
    """The train, eval and predict steps of one model, loss, optimizer and metrics."""
    return {"train": make_train_step(apply, loss_fn, optimizer, loss_tracker, metrics, num_replicas),
            "eval": make_eval_step(apply, loss_fn, loss_tracker, metrics, num_replicas),
            "predict": make_predict_step(apply)}
