"""The layout of a trainer's state, as data: where its weights and optimizer state lie
(replicated on every device, `Replicated`; or laid out by a `ShardingPlan`, `Sharded`), their
stored shapes (padding), how each gradient is reduced, and the bytes each device will hold.
Data parallelism is the layout in which every variable is whole; one training program is made
from a step and a layout (`lockstep.training`).

A sharded step is one `jax.jit` around two parts. The replicas' part (a `shard_map` over the
batch axis only; the model axes stay the compiler's, which lays out their shards) computes each
replica's gradient on its rows with the parameters gathered whole along the batch axis, and
reduce-scatters it along each parameter's ZeRO dimension. The update runs outside it, on the
shards, as the compiler partitions any optax transform (a global-norm clip included): so a step
moves about 2P bytes (P gathered or all-gathered, P reduce-scattered) and equals the replicated
step up to the order of the gradient's sums.

A variable that its splits do not divide is stored padded with zeros (the plan's `stored_shape`):
the model sees it cut to its shape (`on_stored`), so its gradient comes out padded with zeros;
the update runs on the variables', gradients' and optimizer state's own shapes and is padded
again; what leaves the trainer (`unpadded_params`, `unpadded_state`: Keras variables, backups) has
the variable's own shape.

>>> import jax, numpy as np, optax, lockstep as ls
>>> engine = ls.MirroredStrategy(4).extended
>>> params = {"trainable": {"w": np.zeros((3, 8), np.float32)}, "non_trainable": {}}
>>> type(state_layout(engine, None, optax.adam(0.1), params, {"trainable": {"w": "w"}, "non_trainable": {}})).__name__
'Replicated'
>>> sharded = ShardingConfig(rules=(), zero_stage=3, min_shard_size=1)
>>> layout = state_layout(engine, sharded, optax.adam(0.1), params, {"trainable": {"w": "w"}, "non_trainable": {}})
>>> layout.estimate(params)   # bytes a device holds: 6 of w's 24 float32s; of each Adam moment's; the count
{'parameters': 24, 'gradients': 24, 'optimizer_state': 52, 'total': 100}
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..engine import replicas_axis, spread
from ._plan import ShardingConfig, ShardingPlan, VariableLayout, fit_to, shard_bytes

#: How an optimizer's state follows its parameters, where optax cannot tell (a Keras optimizer's
#: slots): ``slots(opt_state, mapped, per_param, other)`` is `mapped` (optax's ``tree_map_params``
#: of the state: each parameter's value from `per_param`, a tree like the trainable parameters,
#: the rest `other`) with the states optax left as `other` mapped too. An optimizer given slots
#: makes its state itself (Keras makes its variables, in their layouts): `Sharded` places it, where
#: it otherwise makes a state on the devices already laid out.
Slots = Callable[[Any, Any, Any, Any], Any]


#: An optimizer-state array that belongs to no parameter (a step count, a scalar).
_NOT_A_PARAM = object()


class Replicated:
    """Weights and optimizer state copied to every device of `engine`: the layout in which every
    variable is whole, its gradient summed over the replicas (an all-reduce)."""

    plan: ShardingPlan | None = None
    #: gradient accumulators hold each replica's share (reduced per micro-batch), not its whole gradient
    shards_accumulators = False
    #: the update runs inside the replicas' program (every replica holds the whole state), not outside it
    update_in_replica = True
    #: how the replicas' gradient step returns the reduced gradients (`lockstep.engine`'s kinds)
    gradient_kinds: Any = "replicated"

    def __init__(self, engine: Any, optimizer: optax.GradientTransformation):
        self._engine = engine
        self._optimizer = optimizer
        self._replicated = NamedSharding(engine.mesh, P())
        self._out: dict[Any, Any] = {}

    def reduce(self, grads: Any) -> Any:
        """Inside a replica: the replicas' gradients summed, whole on every replica."""
        return jax.lax.psum(grads, replicas_axis())

    def update(self, grads: Any, opt_state: Any, trainable: Any) -> tuple[Any, Any]:
        """(trainable parameters, optimizer state) after one update with the reduced `grads`."""
        return updated(self._optimizer, grads, opt_state, trainable)

    def param_shardings(self, params: Any) -> Any:
        """Where each stored parameter lies."""
        return jax.tree.map(lambda _: self._replicated, params)

    def out_shardings(self, params: Any, opt_state: Any) -> tuple[Any, Any, Any]:
        """Where a training program leaves parameters, optimizer state and the per-replica metric
        states (one tree per structure of the optimizer state)."""
        key = (jax.tree.structure(params), jax.tree.structure(opt_state))
        out = self._out.get(key)
        if out is None:
            out = self._out[key] = (self.param_shardings(params), self.state_shardings(opt_state),
                                    NamedSharding(self._engine.mesh, P(self._engine.batch_axis)))
        return out

    def params(self, params: Any) -> Any:
        return self._engine.put_replicated(params)

    def opt_state(self, opt_state: Any) -> Any:
        return self._engine.put_replicated(opt_state)

    def abstract_state(self, params: Any) -> tuple[Any, Any]:
        """The stored parameters and a fresh optimizer state for `params` (arrays or shapes in
        their variables' shapes) as `jax.ShapeDtypeStruct`s laid out where they would lie: what a
        program compiled ahead of time takes, before any of them exists on a device."""
        stored, opt_state = jax.eval_shape(
            lambda p: (self._stored_params(p), self._stored_state(self._optimizer.init(p["trainable"]))), params)

        def laid_out(tree: Any, shardings: Any) -> Any:
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type),
                                tree, shardings)
        return laid_out(stored, self.param_shardings(stored)), laid_out(opt_state, self.state_shardings(opt_state))

    def _stored_params(self, params: Any) -> Any:
        """Parameters in their variables' shapes as stored (in a program; nothing is padded here)."""
        return params

    def _stored_state(self, opt_state: Any) -> Any:
        """An optimizer state in its variables' shapes as stored (in a program; nothing is padded here)."""
        return opt_state

    def init_opt_state(self, params: Any) -> Any:
        """A fresh optimizer state for the (placed) trainable parameters of `params`."""
        return self._engine.put_replicated(self._optimizer.init(params["trainable"]))

    def on_stored(self, apply: Callable[..., Any]) -> Callable[..., Any]:
        """The model's ``apply(params, x, training)`` taking parameters as they are stored."""
        return apply

    def unpadded_params(self, params: Any, cut: bool = True) -> Any:
        """Stored parameters in their own shapes (nothing is padded here; `cut`: see `Sharded`)."""
        return params

    def shapes(self, params: Any, opt_state: Any) -> list[tuple[int, ...]]:
        """The shape of each array of stored parameters and optimizer state once unpadded (in the
        order of ``jax.tree.leaves((params, opt_state))``; nothing is padded here)."""
        return [tuple(np.shape(x)) for x in jax.tree.leaves((params, opt_state))]

    def unpadded_state(self, opt_state: Any, cut: bool = True) -> Any:
        """A stored optimizer state in its own shapes (nothing is padded here)."""
        return opt_state

    def unpadded(self, state: Any) -> Any:
        """A `TrainState` whose weights and optimizer state have the variables' own shapes."""
        return state.replace(params=self.unpadded_params(state.params), opt_state=self.unpadded_state(state.opt_state))

    def state_shardings(self, opt_state: Any) -> Any:
        """Where each array of an optimizer state (arrays or their shapes) lies."""
        return jax.tree.map(lambda _: self._replicated, opt_state)

    def estimate(self, params: Any) -> dict[str, int]:
        """Bytes each device holds, before any array exists (`params`: a tree of arrays or of
        `jax.ShapeDtypeStruct`s): parameters and optimizer state at rest, and the gradients of a step."""
        opt_state = jax.eval_shape(self._optimizer.init, params["trainable"])
        param_specs = (jax.tree.map(lambda _: P(), params) if self.plan is None
                       else jax.tree.map(lambda s: s.spec, self.plan.shardings("param")))
        grads = (sum(_bytes(x, P(), self._engine.mesh) for x in jax.tree.leaves(params["trainable"]))
                 if self.plan is None else self.plan.gradient_bytes_per_device())
        out = {"parameters": sum(_bytes(x, s, self._engine.mesh) for x, s in
                                 zip(jax.tree.leaves(params), jax.tree.leaves(param_specs))),
               "gradients": grads,
               "optimizer_state": sum(_bytes(x, sh.spec, self._engine.mesh) for x, sh in
                                      zip(jax.tree.leaves(opt_state), jax.tree.leaves(self.state_shardings(opt_state))))}
        out["total"] = sum(out.values())
        return out


class Sharded(Replicated):
    """Weights and optimizer state laid out by `plan` (see `lockstep.sharding`)."""

    def __init__(self, engine: Any, optimizer: optax.GradientTransformation, plan: ShardingPlan,
                 slots: Slots | None = None):
        super().__init__(engine, optimizer)
        self.plan = plan
        self.shards_accumulators = plan.zero_stage >= 2  # stages 2 and 3: each replica accumulates its share
        self.update_in_replica = False  # on the shards, as the compiler partitions it
        self.gradient_kinds = plan.gradient_specs()["trainable"]
        self._slots = slots  # how the optimizer's state follows the parameters where optax cannot tell
        self._param_shardings = plan.shardings("param")
        self._state_shardings: Any = None
        self._layouts = plan.tree(plan.variables)  # each parameter's `VariableLayout`, a tree like the parameters
        self._padded = any(v.padded for v in plan.variables)
        self._state_layouts: Any = None
        self._cuts: dict[Any, Callable[..., Any]] = {}

    def params(self, params: Any) -> Any:
        return self._engine.place(self._padded_for(params, self._layouts, "param_spec"), self._param_shardings)

    def param_shardings(self, params: Any) -> Any:
        return self._param_shardings

    def _per_state(self, opt_state: Any, per_param: Any, other: Any) -> Any:
        """A tree like `opt_state`: each parameter's state (Adam's moments) given that parameter's
        value in `per_param` (a tree like the trainable parameters), the rest (counts, scalars) `other`."""
        out = optax.tree_map_params(self._optimizer, lambda _, value: value, opt_state, per_param,
                                    transform_non_params=lambda _: other)
        return out if self._slots is None else self._slots(opt_state, out, per_param, other)

    def state_shardings(self, opt_state: Any) -> Any:
        """Where each array of an optimizer state (arrays or their shapes) lies: a parameter's
        state (Adam's moments) as the plan's state layout, the rest (step counts, scalars) replicated."""
        if self._state_shardings is None:
            self._state_shardings = self._per_state(opt_state, self.plan.shardings("state")["trainable"],
                                                    self._replicated)
        return self._state_shardings

    def _layouts_of_state(self, opt_state: Any) -> Any:
        """Each optimizer-state array's variable layout (`_NOT_A_PARAM` for counts and scalars)."""
        if self._state_layouts is None:
            self._state_layouts = self._per_state(opt_state, self._layouts["trainable"], _NOT_A_PARAM)
        return self._state_layouts

    def opt_state(self, opt_state: Any) -> Any:
        return self._engine.place(self._padded_for(opt_state, self._layouts_of_state(opt_state), "state_spec"),
                                  self.state_shardings(opt_state))

    def init_opt_state(self, params: Any) -> Any:
        """A fresh optimizer state made on the devices already laid out (no device holds a whole one;
        an optimizer with `slots` of its own, a Keras optimizer, made them in their layouts)."""
        if self._slots is not None:
            return self.opt_state(self._optimizer.init(params["trainable"]))
        shapes = jax.eval_shape(self._optimizer.init, params["trainable"])
        return self._engine.jit(lambda t: self._stored_state(self._optimizer.init(self._cut(t))),
                                self.state_shardings(shapes))(params["trainable"])

    # --- padding (see the module doc) ------------------------------------------------------
    def _cut(self, trainable: Any) -> Any:
        """Stored trainable arrays (parameters, gradients) cut to their variables' shapes (in a program)."""
        return jax.tree.map(lambda x, v: fit_to(x, v.shape), trainable, self._layouts["trainable"])

    def _stored(self, params: Any, kind: str = "trainable") -> Any:
        """The `kind` part of the parameters padded as stored (in a program)."""
        return jax.tree.map(lambda x, v: fit_to(x, v.stored_shape(v.param_spec)), params, self._layouts[kind])

    def _stored_params(self, params: Any) -> Any:
        return {"trainable": self._stored(params["trainable"]), "non_trainable": self._stored(params["non_trainable"],
                                                                                           "non_trainable")}

    def _stored_state(self, opt_state: Any) -> Any:
        """An optimizer state in its variables' shapes padded as stored (in a program)."""
        return _fit_state(opt_state, self._layouts_of_state(opt_state), True) if self._padded else opt_state

    def _cut_state(self, opt_state: Any) -> Any:
        """A stored optimizer state cut to its variables' shapes (in a program)."""
        return _fit_state(opt_state, self._layouts_of_state(opt_state), False) if self._padded else opt_state

    def _padded_for(self, tree: Any, layouts: Any, spec: str) -> Any:
        """Arrays in their variables' shapes (host arrays or global ones) padded as stored under
        each layout's `spec`, for `place` (a global array spread over workers is padded on the
        devices, in its stored layout)."""
        if not self._padded:
            return tree

        def one(x: Any, v: Any) -> Any:
            if not isinstance(v, VariableLayout) or tuple(x.shape) != v.shape:
                return x
            target = v.stored_shape(getattr(v, spec))
            if target == v.shape:
                return x
            if spread(x):
                return self._cutter(target, NamedSharding(self.plan.mesh, getattr(v, spec)))(x)
            return fit_to(np.asarray(x), target)
        return jax.tree.map(one, tree, layouts)

    def _cutter(self, shape: tuple[int, ...], sharding: NamedSharding) -> Callable[..., Any]:
        """A compiled `fit_to(x, shape)` whose result lies as `sharding` (one per shape and sharding)."""
        key = (shape, sharding)
        if key not in self._cuts:
            self._cuts[key] = self._engine.jit(functools.partial(fit_to, shape=shape), sharding)
        return self._cuts[key]

    def _unpadded(self, tree: Any, layouts: Any, spec: str, cut: bool) -> Any:
        """Stored arrays (`layouts`: each one's variable layout) cut to their variables' shapes,
        laid out as their `spec` without the splits that do not divide them (`cut=False`: None
        for each that is stored padded, the rest as they are)."""
        def one(x: Any, v: Any) -> Any:
            if not isinstance(v, VariableLayout):
                return x
            padded = v.stored_shape(getattr(v, spec))
            if padded == v.shape or tuple(x.shape) != padded:  # not padded (or not an array shaped like it)
                return x
            return self._cutter(v.shape, NamedSharding(self.plan.mesh, v.even(getattr(v, spec))))(x) if cut else None
        return tree if not self._padded else jax.tree.map(one, tree, layouts)

    def shapes(self, params: Any, opt_state: Any) -> list[tuple[int, ...]]:
        """The shape of each array of stored parameters and optimizer state once unpadded (in the
        order of ``jax.tree.leaves((params, opt_state))``)."""
        layouts = jax.tree.leaves((self._layouts, self._layouts_of_state(opt_state)))
        return [v.shape if isinstance(v, VariableLayout) and tuple(x.shape) in (
                    v.stored_shape(v.param_spec), v.stored_shape(v.state_spec)) else tuple(x.shape)
                for x, v in zip(jax.tree.leaves((params, opt_state)), layouts)]

    def unpadded_params(self, params: Any, cut: bool = True) -> Any:
        """Stored parameters in their own shapes, each laid out as `variable_spec` says (a padded
        variable without the splits that do not divide it). With several workers, a collective:
        every worker calls it. `cut=False`: no program, None for each parameter stored padded (what
        can be lent as it lies: `TrainerWeights.lend_state`)."""
        return self._unpadded(params, self._layouts, "param_spec", cut)

    def unpadded_state(self, opt_state: Any, cut: bool = True) -> Any:
        """A stored optimizer state in its variables' shapes (see `unpadded_params`)."""
        return self._unpadded(opt_state, self._layouts_of_state(opt_state), "state_spec", cut)

    def on_stored(self, apply: Callable[..., Any]) -> Callable[..., Any]:
        """The model's ``apply(params, x, training)`` taking parameters as they are stored: cut
        to their shapes for the model (so a gradient comes out padded with zeros), the new
        non-trainable state padded back."""
        if not self._padded:
            return apply

        def stored_apply(params: Any, x: Any, training: bool) -> Any:
            cut = jax.tree.map(lambda a, v: fit_to(a, v.shape), params, self._layouts)
            y, non_trainable, penalty = apply(cut, x, training)
            stored = self._stored(non_trainable, "non_trainable")  # what the call left alone: the very arrays given
            return y, jax.tree.map(lambda new, given, old, kept: kept if new is given else old, non_trainable,
                                   cut["non_trainable"], stored, params["non_trainable"]), penalty
        return stored_apply

    def update(self, grads: Any, opt_state: Any, trainable: Any) -> tuple[Any, Any]:
        """`updated` on the variables' own shapes (gradients as reduce-scattered, the rest as
        stored), its results padded as stored."""
        if not self._padded:
            return updated(self._optimizer, grads, opt_state, trainable)
        new, opt_state = updated(self._optimizer, self._cut(grads), self._cut_state(opt_state),
                                 self._cut(trainable))
        return self._stored(new), self._stored_state(opt_state)

    def reduce(self, grads: Any) -> Any:
        """Inside a replica: its share of the trainable gradients summed over the replicas, split
        along each parameter's ZeRO dimension (a reduce-scatter), whole where the plan keeps it whole.
        Under hybrid sharding the reduce-scatter runs along the ZeRO axis (within a node), then
        its shards are summed along the axes of whole copies (across nodes)."""
        axis, copies = replicas_axis(), self.plan.replica_axes

        def one(g: Any, v: VariableLayout) -> Any:
            g = fit_to(g, v.stored_shape(v.state_spec))  # padded as the optimizer state is stored
            if v.zero_dim is None or not self.plan.zero_stage:
                return jax.lax.psum(g, axis)
            g = jax.lax.psum_scatter(g, self.plan.zero_axis, scatter_dimension=v.zero_dim, tiled=True)
            return jax.lax.psum(g, copies) if copies else g
        return jax.tree.map(one, grads, self._layouts["trainable"])


def _fit_state(opt_state: Any, layouts: Any, stored: bool) -> Any:
    """An optimizer state's parameter arrays (`layouts`: each one's variable layout) fitted to
    their stored shapes, or to their variables' own; arrays shaped otherwise than either (a
    factored state) are left alone."""
    def one(x: Any, v: Any) -> Any:
        if v is _NOT_A_PARAM:
            return x
        padded = v.stored_shape(v.state_spec)
        source, target = (v.shape, padded) if stored else (padded, v.shape)
        return fit_to(x, target) if tuple(x.shape) == source else x
    return jax.tree.map(one, opt_state, layouts)


def _bytes(x: Any, spec: P, mesh: Any) -> int:
    """Bytes of one device's shard of an array shaped like `x` laid out by `spec` on `mesh`."""
    return shard_bytes(tuple(x.shape), np.dtype(x.dtype).itemsize, spec, dict(zip(mesh.axis_names, mesh.devices.shape)))


def updated(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, trainable: Any) -> tuple[Any, Any]:
    """(trainable parameters, optimizer state) after one update with the global `grads`."""
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state


def state_layout(engine: Any, sharding: ShardingConfig | None, optimizer: optax.GradientTransformation, params: Any,
                 paths: Any, slots: Slots | None = None) -> Replicated:
    """The layout of a state `params` (``{"trainable": tree, "non_trainable": tree}`` of arrays or
    shapes; `paths` alike, their variables' paths) and its `optimizer`'s state on `engine`'s mesh:
    `Sharded` by `sharding`'s plan, or `Replicated` where `sharding` is None; `slots`: how the
    optimizer's state follows the parameters where optax cannot tell (a Keras optimizer's)."""
    if sharding is None:
        return Replicated(engine, optimizer)
    trainable = {"trainable": jax.tree.map(lambda _: True, params["trainable"]),
                 "non_trainable": jax.tree.map(lambda _: False, params["non_trainable"])}
    plan = sharding.plan(engine.mesh, engine.batch_axis, params, paths, trainable)
    return Sharded(engine, optimizer, plan, slots)
