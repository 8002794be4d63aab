"""Compiled-step factories: small pure functions that `Trainer` wires together.

Each factory returns a function of plain arrays for `strategy.extended.run_arrays`: it sees
one replica's rows of a distributed batch (`data`), their mask (1.0 real, 0.0 padding) and the
step's real sample count, and passes both explicitly to the loss and the metrics, so padding
rows never count.

The steps run with `shard_map`'s replication typing off (`CHECK_VMA = False`): a `lax.scan`
whose carry starts replicated (zeros) and becomes per-replica — every Keras recurrent layer —
then traces on any number of replicas. The price is that JAX no longer sums the gradients of
replicated parameters over replicas by itself: the gradient step returns each replica's share and
the state layout combines them (`lockstep.sharding.state_layout`: a `psum`, or a reduce-scatter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..engine import ReduceOp, all_reduce, get_replica_context, replicas_axis
from ..losses import keras_mask, masked_average_loss, weighted_per_sample
from ..metrics import Mean, MetricCollection

Apply = Callable[[Any, Any, bool], tuple[Any, Any, jax.Array | None]]
LossFn = Callable[[Any, Any], jax.Array]

#: the name `jax.checkpoint`'s policy keeps under ``remat="layers"``: what a model adapter's
#: `layers_named` calls its layers' outputs
LAYER_OUTPUT = "lockstep_layer_output"

#: Steps are traced without replication typing (see the module docstring).
CHECK_VMA = False

#: The kinds of the steps' arguments and results (see `lockstep.engine._compiler`).
EVAL_KINDS = ("replicated", "per_replica", "rows", "rows", "replicated")
PREDICT_KINDS = ("replicated", "rows", "rows", "replicated")
#: the eval and predict steps' results: the logs' states or the outputs, and the state the model changed
INFERENCE_OUT_KINDS = ("per_replica", "replicated")


#: `remat` names besides JAX's checkpoint policies (`jax.checkpoint_policies`): "full" saves only the
#: step's inputs, "dots" what MaxText's "save dots" saves, "offload" moves those to host memory
REMAT_ALIASES = {"full": None, "layers": "save_only_these_names", "dots": "dots_with_no_batch_dims_saveable",
                 "offload": "offload_dot_with_no_batch_dims"}


def checked_remat(remat: Any) -> str | None:
    """`remat` when it names activation checkpointing lockstep knows (None or "none": off), else a
    ValueError naming it and the choices.

    >>> checked_remat("dots"), checked_remat(None)
    ('dots', None)
    """
    if remat is None or remat == "none":
        return None
    policies = sorted(n for n in dir(jax.checkpoint_policies) if n.endswith("_saveable") or n.startswith("offload_dot"))
    if not isinstance(remat, str) or (remat not in REMAT_ALIASES and remat not in policies):
        raise ValueError(f"`remat` must be None, 'none', {', '.join(map(repr, REMAT_ALIASES))} or one of JAX's "
                         f"checkpoint policies ({', '.join(policies)}), got remat={remat!r}.")
    return remat


def rematerialized(apply: Apply, remat: str | None,
                   layers_named: Callable[[], Any] = contextlib.nullcontext) -> Apply:
    """`apply` whose activations are recomputed in the backward pass rather than kept from the
    forward pass (`jax.checkpoint`), keeping what `remat`'s policy saves ("full": nothing but the
    inputs; "layers": each layer's output, which `layers_named()` names while the model is traced;
    see `checked_remat`). The numbers are the same; the step computes the forward pass twice, or
    in part.

    >>> import jax.numpy as jnp
    >>> apply = lambda p, x, training: (jnp.sin(x * p), [], None)
    >>> jax.grad(lambda p: rematerialized(apply, "full")(p, jnp.ones(3), True)[0].sum())(2.0)
    Array(-1.2484405, dtype=float32, weak_type=True)
    """
    if remat is None:
        return apply
    name = REMAT_ALIASES.get(remat, remat)
    policy = None if name is None else getattr(jax.checkpoint_policies, name)
    if name is not None and name.startswith("offload"):
        policy = policy("device", "pinned_host")
    named: Callable[[], Any] = contextlib.nullcontext
    if remat == "layers":
        policy, named = policy(LAYER_OUTPUT), layers_named

    def checkpointed(params: Any, x: Any, training: bool) -> Any:
        # a new function each trace: jax.checkpoint caches a function's trace (keyed by the function and
        # its inputs' shapes, not by the trace it runs in) with the values it closes over (the replica
        # context's rows, which BatchNormalization reads), so any second program traced with the same
        # shapes (another run length of `steps_per_execution`, a second `fit`) got the first's tracers
        def forward(params: Any, x: Any) -> Any:
            with named():
                return apply(params, x, training)
        return jax.checkpoint(forward, policy=policy)(params, x)
    return checkpointed


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


def weighted_losses(loss_fn: LossFn, y: Any, y_pred: Any, sample_weight: Any) -> jax.Array:
    """Per-sample losses times the sample weights (a loss over several outputs weighs each output's
    losses by its own sample weights itself)."""
    return weighted_per_sample(loss_fn, y, y_pred, sample_weight)


def global_penalty(penalty: jax.Array | None, num_replicas: int) -> jax.Array | None:
    """The step's whole penalty (regularisers, `add_loss`) from each replica's: every replica
    contributes ``penalty / num_replicas`` (see `_model`), so the sum counts it once."""
    return None if penalty is None else jax.lax.psum(penalty / num_replicas, replicas_axis())


def update_logs(loss_tracker: Mean, metrics: MetricCollection, state: dict[str, Any], y: Any, y_pred: Any,
                per_example: jax.Array, sample_weight: Any, mask: jax.Array,
                penalty: jax.Array | None = None) -> dict[str, Any]:
    """The epoch's running state after one batch: the loss as Keras reports it (Σ w·loss / samples:
    `per_example` is already weighted, plus the step's penalty, which Keras adds to every batch's
    loss) and every metric, over the real rows (`mask`)."""
    new = dict(state)
    logged = per_example
    if penalty is not None:
        logged = logged + penalty.astype(logged.dtype)
    new["loss"] = loss_tracker.update(state["loss"], logged, mask=mask)
    if keras_mask(y_pred) is not None and (blind := [n for n, m in metrics.metrics.items()
                                                     if not getattr(m, "reads_keras_masks", False)]):
        raise ValueError(
            f"the model's output carries a Keras mask (Embedding(mask_zero=True) or Masking, kept to the output), which "
            f"Keras' metrics leave masked elements out by, but the metrics {blind} are lockstep's own (given by name), "
            "which count every element: give Keras metric objects instead (say, "
            "keras.metrics.SparseCategoricalAccuracy()), which lockstep updates with the mask as Keras does.")
    new.update(metrics.update({k: state[k] for k in metrics.metrics}, y, y_pred, sample_weight=sample_weight,
                              mask=mask))
    return new


def _agree_non_trainable(values: Any, mask: jax.Array) -> Any:
    """Non-trainable state updated from local data (batch-norm statistics) is averaged over
    replicas (weighted by real samples); integer state (seed counters) is the same everywhere."""
    local = jnp.sum(mask)

    def agree(v: jax.Array) -> jax.Array:
        op = ReduceOp.MEAN if jnp.issubdtype(v.dtype, jnp.floating) else ReduceOp.MAX
        return all_reduce(op, v, local, replicas_axis())
    return jax.tree.map(agree, values)


def _local_gradients(apply: Apply, loss_fn: LossFn, num_replicas: int, params: dict[str, Any], x: Any, y: Any,
                     sw: Any, mask: jax.Array, count: jax.Array, scale: jax.Array | None) -> tuple[Any, tuple[Any, ...]]:
    """This replica's share of the gradient of the step's mean loss (its sum over replicas is the
    global gradient), unscaled when a loss `scale` is given; and (y_pred, weighted per-example
    losses, new non-trainable state, penalty)."""

    def objective(trainable: Any) -> tuple[jax.Array, Any]:
        y_pred, non_trainable, penalty = apply({"trainable": trainable, "non_trainable": params["non_trainable"]},
                                               x, True)
        per_example = weighted_losses(loss_fn, y, y_pred, sw)
        loss = masked_average_loss(per_example, mask, count)
        if penalty is not None:  # a model's own penalties count once per step: 1/R on each replica
            loss = loss + penalty / num_replicas
        return (loss if scale is None else loss * scale), (y_pred, per_example, non_trainable, penalty)

    (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params["trainable"])
    if scale is not None:
        grads = jax.tree.map(lambda g: g / scale, grads)
    return grads, aux


def make_gradient_step(apply: Apply, loss_fn: LossFn, loss_tracker: Mean, metrics: MetricCollection,
                       num_replicas: int) -> Callable[..., Any]:
    """This replica's share of the step's gradient (summed over the replicas by the state layout's
    `reduce`, it is the gradient of the step's mean loss), with the agreed non-trainable state
    and the logs: ``(params, loss_scale, state, data, mask, count) -> (grads, non_trainable, logs)``.

    >>> import jax, jax.numpy as jnp, lockstep as ls
    >>> from lockstep.metrics import Mean, MetricCollection
    >>> step = make_gradient_step(lambda p, x, training: (x * p["trainable"][0], [], None),
    ...                           lambda y, y_pred: (y - y_pred) ** 2, Mean(), MetricCollection({}), 1)
    >>> state = {"loss": Mean().init()}
    >>> grads, _, logs = ls.MirroredStrategy(1).run(lambda: step(
    ...     {"trainable": [jnp.float32(1.0)], "non_trainable": []}, None, state,
    ...     (jnp.ones(2), jnp.zeros(2)), jnp.ones(2), jnp.float32(2)))
    >>> float(grads[0])   # d/dw of mean((x w - 0)^2) at w = 1 (one replica: its share is the whole)
    2.0
    """

    def gradient_step(params: dict[str, Any], scale: jax.Array | None, state: dict[str, Any], data: Any,
                      mask: jax.Array, count: jax.Array) -> Any:
        x, y, sw = unpack(data)
        grads, (y_pred, per_example, non_trainable, penalty) = _local_gradients(
            apply, loss_fn, num_replicas, params, x, y, sw, mask, count, scale)
        logs = update_logs(loss_tracker, metrics, state, y, y_pred, per_example, sw, mask,
                           global_penalty(penalty, num_replicas))
        return grads, _agree_non_trainable(non_trainable, mask), logs

    return gradient_step


def changed_state(before: Any, after: Any, mask: jax.Array) -> dict[int, jax.Array]:
    """The arrays of the non-trainable state `after` an inference call that the call changed (not
    those of `before`: Monte-Carlo dropout's seed state, `BatchNormalization` called with
    ``training=True``), by their place among its leaves, agreed over the replicas as a training
    step's; none for a model that changes nothing in inference (the usual case: nothing to return).

    >>> import jax.numpy as jnp
    >>> kept, seed = jnp.zeros(2), jnp.ones(2, jnp.int32)
    >>> changed_state([kept, seed], [kept, seed + 1], jnp.ones(3))  # one replica: nothing to agree on
    {1: Array([2, 2], dtype=int32)}
    """
    olds, news = jax.tree.leaves(before), jax.tree.leaves(after)
    changed = {i: new for i, (old, new) in enumerate(zip(olds, news)) if new is not old}
    return _agree_non_trainable(changed, mask) if changed and get_replica_context() is not None else changed


def with_changed(params: dict[str, Any], changed: dict[int, jax.Array]) -> dict[str, Any]:
    """`params` with the non-trainable arrays an inference step changed (`changed_state`'s), each
    laid out as the one it replaces."""
    if not changed:
        return params
    leaves, tree = jax.tree.flatten(params["non_trainable"])
    for i, new in changed.items():
        old = leaves[i]
        leaves[i] = new if getattr(old, "sharding", None) in (None, new.sharding) else jax.device_put(new, old.sharding)
    return {**params, "non_trainable": jax.tree.unflatten(tree, leaves)}


def make_eval_step(apply: Apply, loss_fn: LossFn, loss_tracker: Mean, metrics: MetricCollection,
                   num_replicas: int) -> Callable[..., Any]:
    """Loss and metrics of one replica's rows, accumulated into the running state, and the
    non-trainable state the model changed (`changed_state`; Keras' evaluate keeps it)."""

    def eval_step(params: dict[str, Any], state: dict[str, Any], data: Any, mask: jax.Array,
                  count: jax.Array) -> tuple[dict[str, Any], dict[int, jax.Array]]:
        x, y, sw = unpack(data)
        y_pred, non_trainable, penalty = apply(params, x, False)
        logs = update_logs(loss_tracker, metrics, state, y, y_pred, weighted_losses(loss_fn, y, y_pred, sw), sw, mask,
                           global_penalty(penalty, num_replicas))
        return logs, changed_state(params["non_trainable"], non_trainable, mask)

    return eval_step


def make_predict_step(apply: Apply) -> Callable[..., Any]:
    """The model's outputs on one replica's rows (padding rows are dropped afterwards), and the
    non-trainable state it changed (`changed_state`; Keras' predict keeps it)."""

    def predict_step(params: dict[str, Any], data: Any, mask: jax.Array, count: jax.Array
                     ) -> tuple[Any, dict[int, jax.Array]]:
        x, _, _ = unpack(data)
        y_pred, non_trainable, _ = apply(params, x, False)
        return y_pred, changed_state(params["non_trainable"], non_trainable, mask)

    return predict_step


def make_steps(apply: Apply, loss_fn: LossFn, loss_tracker: Mean, metrics: MetricCollection,
               num_replicas: int, remat: str | None = None,
               layers_named: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Callable[..., Any]]:
    """The gradient, eval and predict steps of one model, loss and metrics (the update is the
    state layout's, see `lockstep.training._executions`); the gradient step's forward pass
    rematerialized as `remat` says (`rematerialized`)."""
    return {"gradient": make_gradient_step(rematerialized(apply, remat, layers_named), loss_fn, loss_tracker,
                                           metrics, num_replicas),
            "eval": make_eval_step(apply, loss_fn, loss_tracker, metrics, num_replicas),
            "predict": make_predict_step(apply)}
