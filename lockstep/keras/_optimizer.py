"""A Keras 3 optimizer object as a `Trainer` runs it: `KerasOptimizer`, Keras' own update
(`stateless_apply`) as an optax transformation (`from_keras`), its slots laid out as the variables
they belong to, named by variable and slot in backups, its loss scale (a `LossScaleOptimizer`'s)
taken up, and the trained state given back to the object (`to_keras`), as after Keras' `fit`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from .._keras_kind import is_keras
from ..engine import held
from ..sharding import Slots
from ..training import Optimizer, get_optimizer
from ._lending import Lending


def is_loss_scaled(optimizer: Any) -> bool:
    """Whether `optimizer` is a Keras `LossScaleOptimizer` (`compile` wraps one under
    ``mixed_float16`` unless given ``auto_scale_loss=False``)."""
    return hasattr(optimizer, "inner_optimizer") and hasattr(optimizer, "dynamic_growth_steps")


def loss_scale_settings(optimizer: Any) -> tuple[float, int, int]:
    """(scale, growth steps, finite steps since the scale last changed) of a Keras
    `LossScaleOptimizer` (Keras' `compile` wraps the optimizer in one under ``mixed_float16``):
    where it stands after earlier training (a loaded model's), else its initial scale; without
    one, Keras' defaults (2**15, 2000, 0)."""
    if is_loss_scaled(optimizer):
        if optimizer.built:
            return (float(np.asarray(optimizer.dynamic_scale.value)), int(optimizer.dynamic_growth_steps),
                    int(np.asarray(optimizer.step_counter.value)))
        return float(optimizer.initial_scale), int(optimizer.dynamic_growth_steps), 0
    return 2.0**15, 2000, 0


class KerasOptimizerState(NamedTuple):
    """A Keras optimizer's variables as optax state; its learning rate (when a variable, not a
    schedule) sits in `hyperparams`, where `Trainer.learning_rate` reads and sets it."""

    variables: list[Any]
    hyperparams: dict[str, Any]


def from_keras(optimizer: Any, trainable_variables: Any) -> optax.GradientTransformation:
    """A Keras 3 optimizer object as an optax transformation that runs Keras' own update
    (`stateless_apply`: the same formulas, weight decay, clipping, EMA and iteration count as
    `model.fit`), for a Keras model whose trainable variables are `trainable_variables` (the
    parameters are then the list of their values, in that order).

    Raises:
      ValueError: the optimizer accumulates gradients itself (`gradient_accumulation_steps`):
        its micro-steps are averaged without their sample counts.
    """
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            f"the Keras optimizer {type(optimizer).__name__} has gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}: Keras averages micro-steps without weighting them by their "
            "sample counts, which is not the single-device step; leave it unset and pass "
            f"`ls.Trainer(..., gradient_accumulation_steps={optimizer.gradient_accumulation_steps})`, which is.")
    if not optimizer.built:
        optimizer.build(list(trainable_variables))
    built_for = len(getattr(optimizer, "_trainable_variables", trainable_variables))  # what Keras checks too
    lr_at = _learning_rate_index(optimizer)

    def init(params: Any) -> KerasOptimizerState:
        values = [held(v.value) for v in optimizer.variables]
        hyper = {} if lr_at is None else {"learning_rate": values.pop(lr_at)}
        return KerasOptimizerState(values, hyper)

    def update(grads: Any, state: KerasOptimizerState, params: Any = None) -> tuple[Any, KerasOptimizerState]:
        if built_for != len(grads):  # traced with the train step, before any step (evaluate may go on, as in Keras)
            raise ValueError(
                f"the Keras optimizer was built for {built_for} trainable variables and the model now has "
                f"{len(grads)}: a layer's `trainable` changed after `compile`. As in Keras, call "
                "`model.compile(...)` again after changing `trainable`, with a new optimizer object.")
        values = list(state.variables)
        if lr_at is not None:
            values.insert(lr_at, state.hyperparams["learning_rate"])
        new_params, new_values = optimizer.stateless_apply(values, list(grads), list(params))
        new_values = list(new_values)
        hyper = {} if lr_at is None else {"learning_rate": new_values.pop(lr_at)}
        return [n - p for n, p in zip(new_params, params)], KerasOptimizerState(new_values, hyper)

    return optax.GradientTransformation(init, update)  # type: ignore[arg-type]


def keras_state_owners(optimizer: Any, trainable_variables: Any) -> list[int | None]:
    """For each of a Keras optimizer's variables as `from_keras` keeps them (the learning rate
    apart), the index of the trainable variable it belongs to (Keras names it after the variable's
    path: ``adam/dense_kernel_momentum``), or None (the iteration count)."""
    by_path = {v.path.replace("/", "_"): i for i, v in enumerate(trainable_variables)}
    owners: list[int | None] = []
    for v in keras_state_variables(optimizer):
        rest = v.path.split("/", 1)[-1]
        owner = max((p for p in by_path if rest.startswith(p + "_")), key=len, default=None)
        owners.append(None if owner is None else by_path[owner])
    return owners


def keras_slots(optimizer: Any, trainable_variables: Any) -> Slots:
    """How a Keras optimizer's state (its variables, as `from_keras` keeps them) follows the
    trainable variables: `lockstep.sharding`'s `Slots`, each slot laid out as the variable it
    belongs to (`keras_state_owners`), the iteration count and the learning rate as the rest."""
    owners = keras_state_owners(optimizer, trainable_variables)

    def slots(opt_state: Any, mapped: Any, per_param: Any, other: Any) -> Any:
        def keras(state: Any, _: Any) -> Any:
            return KerasOptimizerState([other if i is None else per_param[i] for i in owners],
                                       {k: other for k in state.hyperparams})
        return jax.tree.map(keras, opt_state, mapped, is_leaf=lambda x: isinstance(x, KerasOptimizerState))
    return slots


def keras_state_variables(optimizer: Any) -> list[Any]:
    """A Keras optimizer's variables as `from_keras` keeps them in its state: the learning rate apart."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    variables = list(optimizer.variables)
    lr_at = _learning_rate_index(optimizer)
    if lr_at is not None:
        variables.pop(lr_at)
    return variables


def is_keras_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is a Keras 3 optimizer object."""
    return is_keras(optimizer) and hasattr(optimizer, "stateless_apply")


def _learning_rate_index(optimizer: Any) -> int | None:
    return next((i for i, v in enumerate(optimizer.variables) if v.path.rsplit("/", 1)[-1] == "learning_rate"),
                None)


def to_keras(optimizer: Any, opt_state: Any) -> None:
    """Writes the Keras optimizer state inside `opt_state` (host arrays) into `optimizer`'s own
    variables (iterations, moments, learning rate), so the Keras model holds what was trained:
    `model.save` and a later `fit` continue from it, as after Keras' own `fit`. Nothing to do
    for `optimizer` None (an optax one) or no state yet."""
    if optimizer is None or opt_state is None:
        return
    _loss_scale_to_keras(optimizer, opt_state)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    for v, value in zip(optimizer.variables, keras_values(optimizer, opt_state) or ()):
        v.assign(held(value))


def keras_values(optimizer: Any, opt_state: Any) -> list[Any] | None:
    """The values of `optimizer`'s variables (a Keras optimizer's, not a loss-scaling wrapper's) in
    `opt_state` (lockstep's optimizer state, as `from_keras` keeps them, or a state wrapping it), in
    the order of ``optimizer.variables``; None where it holds none."""
    stack = [opt_state]
    while stack:
        node = stack.pop()
        if isinstance(node, KerasOptimizerState):
            values = list(node.variables)
            lr_at = _learning_rate_index(optimizer)
            if lr_at is not None:
                values.insert(lr_at, node.hyperparams["learning_rate"])
            return values
        if isinstance(node, (tuple, list)):
            stack.extend(node)
    return None


def _loss_scale(optimizer: Any, opt_state: Any) -> list[Any] | None:
    """A Keras `LossScaleOptimizer`'s scale and its count of finite steps since the scale last
    changed, in lockstep's loss-scaling state `opt_state` (the optimizer built first if Keras never
    ran it, so that it has the variables that hold them); None for any other optimizer or state."""
    scale, good = getattr(opt_state, "scale", None), getattr(opt_state, "good_steps", None)
    if not is_loss_scaled(optimizer) or scale is None or good is None:
        return None
    if not optimizer.built:
        optimizer.build(list(optimizer.inner_optimizer._trainable_variables))  # the inner one is built: kept
    return [scale, good]


def _loss_scale_to_keras(optimizer: Any, opt_state: Any) -> None:
    """`_loss_scale` assigned to the `LossScaleOptimizer`'s variables (from host arrays)."""
    if (scale := _loss_scale(optimizer, opt_state)) is not None:
        optimizer.dynamic_scale.assign(np.asarray(scale[0], np.float32))
        optimizer.step_counter.assign(np.asarray(scale[1]).astype(optimizer.step_counter.dtype))




class KerasOptimizer(Optimizer):
    """`given`, a Keras optimizer object (a `LossScaleOptimizer`'s inner one runs; lockstep scales
    the loss itself), for `model`, the Keras model whose trainable variables it updates.

    Raises:
      ValueError: the optimizer accumulates gradients itself (see `from_keras`).
    """

    def __init__(self, given: Any, model: Any):
        self.given, self.model = given, model
        self.inner = getattr(given, "inner_optimizer", given)
        super().__init__(from_keras(self.inner, model.trainable_variables))
        self._lending: Lending | None = None  # the Keras optimizer's variables (`lend`)

    @property
    def slots(self) -> Slots:  # type: ignore[override]
        """Each slot laid out as the variable it belongs to (`keras_slots`)."""
        return keras_slots(self.inner, self.model.trainable_variables)

    @property
    def variables(self) -> list[Any]:
        return list(self.given.variables)

    def loss_scale(self) -> tuple[float, int, int]:
        return loss_scale_settings(self.given)

    def write_back(self, opt_state: Any) -> None:
        to_keras(self.given, opt_state)

    def lend(self, opt_state: Any, whole: bool = False) -> None:
        """The Keras optimizer's variables made to hold the arrays of `opt_state` (the trainer's, as
        they lie) that are theirs (`Lending`; None: a variable keeps what it holds), a loss-scaling
        optimizer's scale and count of finite steps too. `whole`: copies where a variable lies
        otherwise."""
        values = keras_values(self.inner, opt_state)
        if values is not None:
            self._lender().lend(values, copies=whole)
        if (scale := _loss_scale(self.given, opt_state)) is not None:
            self._scale_lender().lend(scale, copies=whole)

    def lent_variables(self, opt_state: Any) -> list[Any]:
        """The Keras optimizer's variables that `lend` (not `whole`) lends arrays of `opt_state`."""
        values = keras_values(self.inner, opt_state)
        lent = [] if values is None else self._lender().takers(values)
        if self.given.built and (scale := _loss_scale(self.given, opt_state)) is not None:  # (not built here)
            lent += self._scale_lender().takers(scale)
        return lent

    def _scale_lender(self) -> Lending:
        """A loss-scaling optimizer's scale and count of finite steps (`_loss_scale`)."""
        return Lending([self.given.dynamic_scale, self.given.step_counter])

    def iterations(self, opt_state: Any) -> Any:
        """Keras' `optimizer.iterations` in `opt_state`: it goes on from an earlier `fit`'s, and a
        loss-scaling optimizer's leaves out the steps it skipped."""
        values = keras_values(self.inner, opt_state)
        at = next((i for i, v in enumerate(self.inner.variables) if v is self.inner.iterations), None)
        return None if values is None or at is None else values[at]

    def _lender(self) -> Lending:
        if self._lending is None:
            self._lending = Lending(list(self.inner.variables))
        return self._lending

    def state_names(self, trainable: list[tuple[str, str]], opt_state: Any) -> tuple[list[str], str]:
        """Its state (`KerasOptimizerState`: its variables, the learning rate apart) named by
        parameter and slot (``dense/kernel:momentum``), else by the variable's own name; a state of
        another layout (loss scaling wraps it) by tree paths."""
        variables = self.model.trainable_variables
        names = []
        for v, owner in zip(keras_state_variables(self.inner), keras_state_owners(self.inner, variables)):
            if owner is None:
                names.append(v.name)
            else:
                slot = v.path.split("/", 1)[-1][len(variables[owner].path.replace("/", "_")) + 1:]
                names.append(f"{trainable[owner][1]}:{slot}")
        hyper = list(getattr(opt_state, "hyperparams", None) or {})
        if not hasattr(opt_state, "hyperparams") or len(names) + len(hyper) != len(jax.tree.leaves(opt_state)):
            names, hyper = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]], []
        return names + hyper, f"keras {type(self.inner).__name__}"


def optimizer_for(given: Any, model: Any) -> Optimizer:
    """How a `Trainer` runs `given` on the Keras `model`: a Keras optimizer object with the
    variables it was built for (`KerasOptimizer`), else `lockstep.training`'s (a name, an optax
    transformation; a Keras optimizer for a model without trainable variables yet is refused there)."""
    if is_keras_optimizer(given) and model.trainable_variables:
        return KerasOptimizer(given, model)
    return Optimizer(get_optimizer(given))
