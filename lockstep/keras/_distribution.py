"""Keras' distribution inside lockstep's scopes: what `keras.distribution.distribution()` answers
while a `strategy.scope()` is active, and how Keras makes and places variables there.

Inside a scope Keras' distribution is a data-parallel one over the scope's devices (a sharded
strategy lays each variable out by its plan), unless the user set another with
`keras.distribution.set_distribution` (lockstep's Trainer then refuses the model: it would ignore
that distribution's layouts). A variable made there remembers the scope's strategy, takes worker
0's value across workers, and a host value assigned to a split variable goes straight to its
shards. Installed once, by `lockstep.keras.install`.

>>> import keras, lockstep as ls
>>> s = ls.MirroredStrategy(2)
>>> with s.scope():
...     len(keras.distribution.distribution().device_mesh.devices.flat)
2
>>> keras.distribution.distribution() is None
True
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .._errors import UsageError, WorkersDisagreeError
from ..distribute import active, remember_scope

_OURS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # strategy -> its distribution


def follow_scopes(keras: Any) -> None:
    """Keras' distribution (its global attribute ``"distribution"``, which `distribution()` and the
    making of variables read) is, where none was set, the active lockstep scope's data-parallel
    distribution (installed once)."""
    if "get_global_attribute" in _PUT:
        return
    from keras.src.backend.common import global_state

    _PUT["get_global_attribute"] = original = global_state.get_global_attribute
    ours = _keras_data_parallel(keras)

    def get_global_attribute(name: str, default: Any = None, set_to_default: bool = False) -> Any:
        value = original(name, default, set_to_default)
        if name != "distribution" or (value is not None and not isinstance(value, ours)):
            return value  # (ours may be left set by Keras' `Distribution.scope()`, which read it)
        strategy = active()
        if strategy is None:
            return None
        made = _OURS.get(strategy)
        if made is None:
            made = _OURS[strategy] = ours(devices=list(strategy.devices))
            made.strategy = weakref.ref(strategy)
        return made
    global_state.get_global_attribute = get_global_attribute  # Keras reads it through the module
    _values_from_worker_0(keras)
    _laid_out_from_the_host()
    _metric_values_local()


def _keras_data_parallel(keras: Any) -> type:
    """Keras' `DataParallel`, except that Keras' own training loops refuse to run under it: they
    would split batches Keras' way (`IndivisibleError` on a short last batch, per-replica
    statistics), not lockstep's (made once, by `follow_scopes`)."""
    class LockstepDataParallel(keras.distribution.DataParallel):  # type: ignore[misc, name-defined]
        strategy: Any = None  # a weak reference to the scope's strategy
        follows_lockstep_scope = True  # what the Trainer takes for no Keras distribution

        def get_variable_layout(self, variable: Any) -> Any:
            _MAKING[:] = [] if getattr(variable, "trainable", True) else [  # a setting: compared, not broadcast
                getattr(variable, "path", None) or getattr(variable, "name", "?")]
            if self.strategy is not None and self.strategy() is not None:  # made in this strategy's scope
                remember_scope(variable, self.strategy())
                layout = getattr(self.strategy(), "keras_variable_layout", None)
                if layout is not None:  # a sharded strategy: the variable is created in its layout
                    return layout(variable)
            return super().get_variable_layout(variable)

        def get_data_layout(self, data_shape: Any) -> Any:  # only Keras' fit/evaluate/predict ask
            raise UsageError(
                "a Keras training loop other than `model.fit` / `evaluate` / `predict` (which lockstep runs) "
                "asked to split a batch inside a lockstep `strategy.scope()`: train with `model.fit` or "
                "`ls.Trainer(model).fit(...)`, which are exact for any batch size, or call it outside the scope.")
    return LockstepDataParallel


_PUT: dict[str, Any] = {}
_MAKING: list[str] = []  # the path of the Keras variable being made (its value is placed next)


def _values_from_worker_0(keras: Any) -> None:
    """Keras variables created (or assigned from the host) on devices of several workers take
    worker 0's value, as TF's multi-worker variables do (JAX would otherwise require every worker
    to hold the same value: an unseeded initialiser fails). A non-trainable scalar made in the
    scope (a learning rate, a momentum: a setting) is compared instead: `WorkersDisagreeError` names
    it and every worker's value. A split variable is made in its shards (see `should_shard_at_init`
    below) when its initialiser is one of Keras' own with an integer seed or none; across workers
    only when the strategy's layouts agree on every worker (`layouts_agreed`, checked when it was
    made), with worker 0's seed given to every worker: the values worker 0 would make. Otherwise it
    is made whole and worker 0's value laid out. (A metric's variable assigned once made keeps each
    worker's value: `_metric_values_local`.) Installed once."""
    if "distribute_tensor" in _PUT:
        return
    try:
        from keras.src.backend.jax import core, distribution_lib
    except ImportError:  # another Keras layout: JAX's own check (the same value on every worker) stays
        return
    _PUT["distribute_tensor"] = original = distribution_lib.distribute_tensor
    _PUT["should_shard_at_init"] = at_init = core.should_shard_at_init

    def should_shard_at_init(layout: Any, shape: Any) -> bool:
        """Whether Keras makes the variable by a program that writes each shard where it lies. A
        split variable is, with an initialiser that may run in a program (`_initialize_with_initializer`):
        no device ever holds it whole (Keras does so only from 250 MB on); across workers only so."""
        if _spans_workers(layout):
            return _AGREED.on
        return (_AGREED.on and not getattr(layout, "is_fully_replicated", True)) or at_init(layout, shape)
    core.should_shard_at_init = should_shard_at_init
    _PUT["initialize_with_initializer"] = initialize = core.JaxVariable._initialize_with_initializer

    def _initialize_with_initializer(variable: Any, initializer: Any) -> None:
        variable._initialize_layout()
        layout = variable._layout
        sharding = getattr(layout, "backend_layout", layout)
        split = not getattr(sharding, "is_fully_replicated", True)
        agreed = None
        if split and _seeded(initializer):
            if not _spans_workers(sharding):
                agreed = initializer
            elif getattr(active(), "layouts_agreed", False):  # every worker splits this variable alike
                agreed = _with_worker_0s_seed(initializer)
        if agreed is None:
            return initialize(variable, initializer)
        _AGREED.on = True
        try:
            return initialize(variable, agreed)
        finally:
            _AGREED.on = False
    core.JaxVariable._initialize_with_initializer = _initialize_with_initializer

    def distribute_tensor(tensor: Any, layout: Any) -> Any:
        sharding = getattr(layout, "backend_layout", layout)
        if _spans_workers(sharding) and _host_value(tensor):
            import jax
            import numpy as np

            from ..engine import broadcast_from_chief

            value = np.asarray(tensor)
            if _ON_READ.on:  # a metric's variable: each worker's own, as lockstep writes them (no collective)
                return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
            making, _MAKING[:] = list(_MAKING), []  # only the value it is made with; later assigns are broadcast
            # (but a metric's, `_ON_READ`, above)
            value = np.asarray(_same_on_every_worker(value, making[0]) if value.ndim == 0 and making
                               else broadcast_from_chief(value))
            # the same on every worker now: placed without `jax.device_put`'s comparison across workers (a
            # second collective over the whole value, which takes NaN, as a diverged training's weights, for a difference)
            return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
        return original(tensor, layout)
    distribution_lib.distribute_tensor = distribute_tensor


class _Agreed(threading.local):
    on = False  # the variable being made has an initialiser every worker runs alike


_AGREED = _Agreed()


class _OnRead(threading.local):
    on = False  # a metric's variable is being assigned


_ON_READ = _OnRead()


def _seeded(initializer: Any) -> bool:
    """Whether `initializer` makes its values from its seed alone, in or out of a compiled program:
    one of Keras' own (a user's may draw from NumPy or read values), seeded by an integer (a
    `SeedGenerator` moves on with each use) or by nothing (constants)."""
    if not type(initializer).__module__.startswith("keras."):
        return False
    if not hasattr(initializer, "seed"):
        return True
    seed = initializer.seed
    return isinstance(seed, int) and not isinstance(seed, bool) and -2**63 <= seed < 2**63


def _with_worker_0s_seed(initializer: Any) -> Any:
    """A `_seeded` initializer with worker 0's seed (a collective: every worker makes the same split
    variable at once, as workers whose strategies' layouts agree do), so that each worker's shards
    are those of worker 0's value (an unseeded script draws other seeds on each worker)."""
    if not hasattr(initializer, "seed"):
        return initializer  # a constant
    import copy

    import numpy as np

    from ..engine import broadcast_from_chief

    halves = np.asarray(broadcast_from_chief(np.array([initializer.seed], np.int64).view(np.uint32)), np.uint32)
    agreed = copy.copy(initializer)
    agreed.seed = int(halves.view(np.int64)[0])
    return agreed


def _metric_values_local() -> None:
    """A metric's variable (Keras makes them ``synchronization="on_read"``, as TF's, which each
    replica keeps) assigned once made (``metric.reset_state()`` in a callback, which one worker may
    call alone) keeps each worker's value, as lockstep writes them (`write_to_keras`): no collective.
    The trainer takes what a callback assigned into the first replica's state (worker 0's); the
    workers compare which metrics they changed (`RunningMetrics`). Installed once."""
    if "direct_assign" in _PUT:
        return
    try:
        from keras.src.backend.jax import core
    except ImportError:  # another Keras layout: Keras' own path stays
        return
    _PUT["direct_assign"] = direct_assign = core.JaxVariable._direct_assign

    def _direct_assign(variable: Any, value: Any) -> None:
        if getattr(variable, "synchronization", None) != "on_read" or getattr(variable, "_value", None) is None:
            return direct_assign(variable, value)
        _ON_READ.on = True
        try:
            return direct_assign(variable, value)
        finally:
            _ON_READ.on = False
    core.JaxVariable._direct_assign = _direct_assign


def _laid_out_from_the_host() -> None:
    """A host value (NumPy, an h5py dataset: what `load_weights`, `load_model` and `set_weights`
    assign) given to a Keras variable that a sharded strategy lays out goes from the host straight
    to its shards, each device receiving only its slice: Keras' JAX variables otherwise make it a
    whole array on the default device first, so that device would hold every variable whole in
    turn (a model that outgrows a device could not be loaded). Installed once."""
    if "convert_to_tensor" in _PUT:
        return
    try:
        from keras.src.backend.common.stateless_scope import in_stateless_scope
        from keras.src.backend.jax import core
    except ImportError:  # another Keras layout: Keras' own path stays
        return
    import jax
    import numpy as np

    _PUT["convert_to_tensor"] = original = core.JaxVariable._convert_to_tensor

    def _convert_to_tensor(variable: Any, value: Any, dtype: Any = None) -> Any:
        layout = getattr(variable, "_layout", None)
        sharding = getattr(layout, "backend_layout", layout)
        if (isinstance(sharding, jax.sharding.NamedSharding) and not sharding.is_fully_replicated
                and not isinstance(value, jax.Array) and hasattr(value, "__array__") and not in_stateless_scope()):
            return np.asarray(value, dtype=None if dtype is None else jax.numpy.dtype(dtype))  # placed by the layout
        return original(variable, value, dtype)
    core.JaxVariable._convert_to_tensor = _convert_to_tensor


def _same_on_every_worker(value: Any, path: str) -> Any:
    """A non-trainable scalar Keras variable's initial `value` (a setting: a learning rate), which
    every worker must give alike (a collective)."""
    import numpy as np
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(value.astype(np.float64))).ravel().tolist()
    if any(v != every[0] and not (v != v and every[0] != every[0]) for v in every):
        raise WorkersDisagreeError(
            f"the workers made the Keras variable {path!r} (a scalar: a setting such as a "
            f"learning rate) with other values: {every}, in worker order. Every worker of a job runs the same script "
            "with the same settings; give it the same value on every worker.")
    return value


def _spans_workers(sharding: Any) -> bool:
    import jax

    devices = getattr(sharding, "device_set", None)
    return jax.process_count() > 1 and devices is not None and len({d.process_index for d in devices}) > 1


def _host_value(tensor: Any) -> bool:
    """A value each worker holds on its own (NumPy, a scalar, or a JAX array not yet placed)."""
    import jax
    import numpy as np

    if isinstance(tensor, jax.core.Tracer):
        return False
    if isinstance(tensor, jax.Array):
        return tensor.is_fully_addressable and not tensor.committed
    return isinstance(tensor, (np.ndarray, np.generic, int, float, bool))
