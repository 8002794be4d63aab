"""`TrainerWeights`: the model's weights as a `Trainer` keeps them — read and written as NumPy
(`get_weights` / `set_weights`), written back into the model object (`sync_model`), lent to the
Keras variables while a user's callback runs (`keras_variables_current`), and the optimizer's
learning rate. A part of `Trainer`, on the state it holds.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ..engine import held, host_value, own_copies, spread, unshared
from ._optimizers import learning_rate_of, set_learning_rate


def host_tree(tree: Any) -> Any:
    """`tree` on the host, but for arrays whose shards other workers hold (see `held`)."""
    return jax.tree.map(held, tree)


def copied_where_held(live: Any, tree: Any) -> Any:
    """`tree` with copies (one program a mesh: `own_copies`) of its arrays that are leaves of
    `live`, the trainer's state, which its next step takes over; the rest as they are."""
    ids = {id(a) for a in jax.tree.leaves((live.params, live.opt_state))}
    return own_copies(tree, lambda a: id(a) in ids)


class TrainerWeights:
    """The weights' methods of `Trainer` (which sets the attributes below)."""

    _state: Any
    _runner: Any
    _adapter: Any
    _layout: Any
    _engine: Any
    _optimizer: Any
    _lent: Any = None  # what the Keras variables were lent as a user's hook began (`keras_variables_current`)
    _built: list[Any] = []  # the arrays of a state made from the model and not yet trained (`lend_state`)
    _lending = False  # in a fit whose Keras variables are lent the state after every step (`lend_state`)

    def _initial_state(self, params: Any) -> None:
        raise NotImplementedError

    def _require_built(self, built_model: bool = False) -> None:
        """Raises unless the trainer holds a state; one that `step_memory` compiled ahead of time
        without placing it is placed now, at its first use, and with `built_model` that of a model
        that has its variables already (a built Keras model)."""
        if self._state is None and (self._runner is not None or (built_model and self._adapter.ready())):
            self._adapter.check_unchanged()
            self._initial_state(self._adapter.build(None))
        if self._state is None:
            raise ValueError("the model has no weights yet: call `fit`, `evaluate` or `predict` first, or build "
                             "the Keras model.")

    def sync_model(self) -> None:
        """Writes the trained weights (and a Keras optimizer's state) into the model object, as
        Keras' `fit` leaves it; `fit` does it on every exit. Without a state (never built, or a
        state `step_memory` compiled and nothing placed since), the model holds its weights already.
        In a `fit` that lends the variables the state (`lend_state`), they are lent it again (what a
        save reads until the next step), not given copies. In a user's hook, what it assigned to
        the variables is taken into the state first (a save writes it, as Keras' would)."""
        self._take_assigned()
        if self._lending and self._state is not None:
            lent = self._lend_all(whole=True)
            if self._lent is not None:
                self._lent = lent  # (what the hook assigns from now on is taken as it ends)
            return
        if self._state is None:
            return
        self._adapter.sync_to_model(host_tree(self._layout.unpadded_params(self._state.params)))
        self._optimizer.write_back(self._layout.unpadded_state(self._state.opt_state))

    @contextlib.contextmanager
    def keras_variables_current(self) -> Iterator[None]:
        """Inside: the Keras model's variables hold the current weights (as they lie on the devices),
        and what user code assigns to them (`layer.kernel.assign(...)`) is the next step's."""
        self._lent = None if self._state is None else \
            self._adapter.lend(self._layout.unpadded_params(self._state.params))
        try:
            yield
            self._take_assigned()
        finally:
            self._lent = None

    def _take_assigned(self) -> None:
        """What user code assigned to the Keras variables since a hook lent them (`_lent`) becomes
        the state's weights."""
        if self._lent is not None and (params := self._adapter.taken(self._lent)) is not None:
            self._state = self._state.replace(params=self._layout.params(params))

    def _built_state(self, state: Any) -> None:
        """Takes `state`, made from the model: arrays the trainer alone holds (`lend_state`; weakly
        referred to, so a state replaced before a fit is freed)."""
        self._state = state
        self._built = [weakref.ref(a) for a in unshared(jax.tree.leaves((state.params, state.opt_state)))]

    def lend_state(self) -> None:
        """As `fit` begins: a state made from the model (`_initial_state`) is the trainer's alone,
        so the first step takes it over uncopied; and the model's Keras variables and a Keras
        optimizer's are lent its arrays, so that the devices hold one copy of the weights and the
        optimizer state, as in Keras' `fit`, whose variables are its state (`keep_lent_current`
        lends them each new one). The variables of a sharded state's arrays stored padded (a split
        that does not divide them) are lent them, cut, in saves (`sync_model`) and, the model's, in
        a user's hooks (`keras_variables_current`) only: a cut is a program (with several workers,
        a collective), too dear for every step."""
        self._runner.adopt([a for ref in self._built if (a := ref()) is not None])
        self._built = []
        self._lending = True  # (until the fit ends: `fit` clears it)
        self._lend_all()

    def _lend_all(self, whole: bool = False) -> Any:
        """The model's and the optimizer's Keras variables lent the state's arrays (a loss-scaling
        optimizer's scale and count of finite steps too), but those stored padded (`whole`: those
        too, cut). A variable holds the very array even where Keras lays the variable out otherwise
        (a ZeRO-sharded moment of a replicated variable: `Lending`). Returns what the model's hold."""
        lent = self._adapter.lend(self._layout.unpadded_params(self._state.params, cut=whole), copies=whole)
        self._optimizer.lend(self._layout.unpadded_state(self._state.opt_state, cut=whole), whole)
        return lent

    def keep_lent_current(self) -> None:
        """After a step: Keras variables lent the state before it (which the step took over: deleted
        arrays, or, after a copy, arrays no longer the state's) are lent the new state, so code that
        reads them outside a user's hook (a writer callback, a lockstep callback) reads the current
        weights (but those stored padded, `lend_state`, and NNX variables laid out otherwise than
        the state, `Lending`), and the devices hold the state once. Called in a `fit` only, after
        `lend_state`."""
        self._lend_all()

    def get_weights(self) -> Any:
        """The model's weights as NumPy arrays (Keras: the list `model.get_weights()` gives)."""
        return self.weights_to_write(later=False)()

    def weights_to_write(self, opt_state: bool = False, later: bool = True) -> Callable[[], Any]:
        """What `get_weights` gives (with `opt_state`: ``{"weights": ..., "opt_state": ...}``, the
        optimizer state as `current_state` has it), as a function that reads it to the host.

        With `later`, the arrays are taken now and read when the function is called, from any
        thread (a background writer's). The arrays the next step takes over are copied on the
        devices in one program, and each copy is let go once read. Arrays whose shards other
        workers hold are gathered now, by every worker (a collective). Without `later`, call the
        function before the next step."""
        self._require_built(built_model=True)
        tree = self._adapter.weights(self._layout.unpadded_params(self._state.params))
        if opt_state:
            tree = {"weights": tree, "opt_state": self._layout.unpadded_state(self._state.opt_state)}
        leaves, treedef = jax.tree.flatten(jax.tree.map(lambda a: host_value(a) if spread(a) else a, tree))
        if later:
            leaves = copied_where_held(self._state, leaves)

        def read() -> Any:
            out = []
            while leaves:
                out.append(host_value(leaves.pop(0)))  # one at a time, each copy let go once on the host
            return jax.tree.unflatten(treedef, out)
        return read

    def set_weights(self, weights: Any) -> None:
        """Replaces the weights (same structure as `get_weights`); a Keras model is kept in sync."""
        self.get_weights()
        params = self._adapter.set_weights(host_tree(self._layout.unpadded_params(self._state.params)), weights)
        self._state = self._state.replace(params=self._layout.params(params))
        self._adapter.sync_to_model(params)

    @property
    def optimizer_iterations(self) -> int:
        """The updates the optimizer applied, as Keras' `optimizer.iterations` counts them: a Keras
        optimizer's count, which goes on from an earlier `fit` and leaves out the steps skipped for
        non-finite gradients (mixed_float16); for another, `global_step` (this `fit`'s steps)."""
        self._require_built()
        count = self._optimizer.iterations(self._state.opt_state)
        return self._state.global_step if count is None else int(host_value(count))

    @property
    def learning_rate(self) -> float:
        """The optimizer's current learning rate (named optimizers, or optax.inject_hyperparams)."""
        self._require_built()
        return float(np.asarray(learning_rate_of(self._state.opt_state)))

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._require_built()
        set_learning_rate(self._state.opt_state, value, self._engine.put_replicated)
