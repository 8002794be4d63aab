"""What makes Keras layers compute, inside a replica, what one device computes on the whole batch.

- `BatchNormalization` takes its batch moments over the real rows of the global batch
  (`lockstep.cross_replica_moments`), or of the replica's own rows when the trainer asks for
  per-replica statistics: the layer's `_moments` is replaced, for good, by one that is Keras'
  own outside a replica.
- An activity regulariser (``activity_regularizer=``, `ActivityRegularization`) sees only the
  real rows, and its penalty is divided by the global batch's real rows instead of the
  replica's padded rows: while a step is traced (`activity_penalties_masked`), each layer's
  regulariser is wrapped, so saving the model never meets the wrapper.
- Keras' random draws (`keras.random.*`: `Dropout`'s mask, `GaussianNoise`, a recurrent layer's
  dropout masks, random augmentation) are drawn for the global batch and each replica takes its
  rows (`random_draws_as_one_device`): every replica holds the same seed generator states, so a
  draw that follows the batch's rows (its first dimension is the rows' at two batch sizes:
  `draws_following_rows`) is the global batch's draw, this replica's rows of it: JAX's
  counter-based draws give element i the hash of counter i whatever the draw's length, so
  `normal` / `uniform` / `truncated_normal` / dropout masks are drawn with counters starting at
  the replica's first element (`_Rows.key`: no more bits than its own rows'), the others drawn
  for the global batch and sliced (the rows past the real ones are padding). Draws of other
  shapes are the same on every replica, as on one device. What cannot be drawn so is refused on
  several replicas: a training call's shuffle of the rows (`keras.random.shuffle`: `MixUp`,
  `CutMix`; a replica holds only its rows) and a `JaxLayer` whose function draws with its `rng`
  (`_jax_layers`).
- A stateful recurrent layer is refused by name (`check_supported`).
- A layer's own `add_loss` term computed from the batch (`check_batch_losses`): each replica
  computes it on its rows, and one device's value is their mean only for a mean over the rows on
  batches every replica fills; another form is refused, a mean warned about.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._keras_kind import defined_in_keras
from ..engine import cross_replica_moments, get_replica_context, replica_context
from ..training import LAYER_OUTPUT
from ._jax_layers import refusing_drawn_calls


def _layers(model: Any) -> list[Any]:
    return model._flatten_layers(include_self=False) if hasattr(model, "_flatten_layers") else list(model.layers)


def _global_moments(layer: Any, inputs: Any, mask: Any = None) -> tuple[jax.Array, jax.Array]:
    """A Keras BatchNormalization layer's batch moments over the global batch (inside a replica)."""
    if get_replica_context() is None:
        return type(layer)._moments(layer, inputs, mask)  # Keras' own
    axes = layer._reduction_axes or [a for a in range(len(inputs.shape)) if a != layer.axis % len(inputs.shape)]
    per_replica = getattr(layer, "_lockstep_batch_statistics", "global") == "per_replica"
    return cross_replica_moments(inputs, axes, mask, across_replicas=not per_replica)


def hook_batch_norm(model: Any, batch_statistics: str) -> None:
    """Gives every `BatchNormalization` layer of `model` lockstep's batch moments."""
    import keras

    for layer in _layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer._lockstep_batch_statistics = batch_statistics
            layer._moments = functools.partial(_global_moments, layer)


def _masked_penalty(layer: Any, regularizer: Any, x: Any) -> jax.Array:
    """`regularizer` on the real rows of `x`, scaled so that Keras' division by the replica's
    rows and the step's division by the number of replicas leave a division by the global count."""
    ctx = get_replica_context()
    x = jnp.asarray(x)
    if ctx is None or ctx.mask is None or x.ndim == 0:
        return regularizer(x)
    rows = ctx.mask
    if x.shape[0] != rows.shape[0]:
        raise ValueError(f"layer {layer.name!r}: its activity_regularizer sees an output of {x.shape[0]} rows, but "
                         f"this replica's batch has {rows.shape[0]}; lockstep needs the batch axis first to leave "
                         "padding rows out of the penalty.")
    real = x * rows.reshape(rows.shape + (1,) * (x.ndim - 1)).astype(x.dtype)
    scale = x.shape[0] * ctx.num_replicas_in_sync / ctx.global_count()
    return regularizer(real) * scale.astype(jnp.result_type(real.dtype, jnp.float32))


#: Keras' step methods a model may override, and where what the override does belongs in lockstep
_STEPS = {
    "train_step": "a loss function in compile(loss=...), a layer's add_loss, or a custom loop with strategy.run",
    "test_step": "metrics in compile(metrics=...) (a keras.metrics.Metric subclass for your own)",
    "predict_step": "post-processing of model.predict's outputs, or a layer at the model's end",
    "compute_loss": "a loss function of (y_true, y_pred) in compile(loss=...), or a layer's add_loss / a "
                    "kernel_regularizer for terms on the weights",
    "compute_metrics": "metrics in compile(metrics=...) (a keras.metrics.Metric subclass for your own)",
}


def overridden_steps(model: Any) -> list[str]:
    """The Keras step methods `model`'s class (or a base of it outside Keras) overrides."""
    out = []
    for name in _STEPS:
        owner = next((c for c in type(model).__mro__ if name in vars(c)), None)
        if owner is not None and not defined_in_keras(owner):
            out.append(f"{owner.__name__}.{name}")
    return out


def check_supported(model: Any) -> None:
    """Raises for what lockstep cannot run as Keras does: an overridden `train_step`, `test_step`,
    `predict_step`, `compute_loss` or `compute_metrics` (lockstep's distributed step would not call
    it), or a stateful recurrent layer (it carries each row's state to the same row of the next
    batch, but rows move between replicas)."""
    overridden = overridden_steps(model)
    if overridden:
        where = "; ".join(f"for {name.split('.')[1]}: {_STEPS[name.split('.')[1]]}" for name in overridden)
        raise ValueError(
            f"the model overrides {', '.join(f'`{n}`' for n in overridden)}: lockstep's fit / evaluate / predict run "
            "their own distributed step, exact on any number of replicas, which would not call it, so the numbers "
            f"would differ from Keras'. Say the same another way: {where}.")
    for layer in _layers(model):
        if getattr(layer, "stateful", False):
            raise ValueError(f"layer {layer.name!r} ({type(layer).__name__}) is stateful: its state carries each row "
                             "into the same row of the next batch, and lockstep spreads a batch's rows over "
                             "replicas, so the step would not be the one-device step. Use stateful=False (pass the "
                             "state as `initial_state` if you need it).")


def check_activity_regularizers(model: Any) -> None:
    """Warns about activity regularisers that may not be a sum over rows (exact only if they are)."""
    import keras

    known = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
    for layer in _layers(model):
        reg = getattr(layer, "activity_regularizer", None)
        if reg is not None and not isinstance(reg, known):
            warnings.warn(f"layer {layer.name!r} has an activity_regularizer of type {type(reg).__name__}: lockstep "
                          "leaves padding rows out of it and divides by the global batch, which equals one device "
                          "only if the penalty is a sum over rows (as L1 and L2 are).", stacklevel=3)


def _added_losses(model: Any, x: Any) -> list[tuple[str, Any]]:
    """(layer name, value) of each `add_loss` term of a training call of `model` on `x`, activity
    regularisers left out (their terms are made exact: `activity_penalties_masked`); each row
    draws the first row's random values (a row's terms alike in a batch of any rows)."""
    layers, added = [model, *_layers(model)], []
    regularizers = [(la, la.activity_regularizer) for la in layers if getattr(la, "activity_regularizer", None)]

    def recording(layer: Any) -> Any:
        own = layer.add_loss

        def add_loss(loss: Any) -> Any:
            added.append((layer.name, loss))
            return own(loss)
        return add_loss
    try:
        for layer, _ in regularizers:
            layer.activity_regularizer = None
        for layer in layers:
            layer.add_loss = recording(layer)
        with _drawing(_Rows(len(jax.tree.leaves(x)[0]), 1, 0, tile=True)):
            model.stateless_call([v.value for v in model.trainable_variables],
                                 [v.value for v in model.non_trainable_variables], x,
                                 **({"training": True} if getattr(model, "_call_has_training_arg", True) else {}))
    finally:
        for layer in layers:
            vars(layer).pop("add_loss", None)
        for layer, reg in regularizers:
            layer.activity_regularizer = reg
    return added


def _another_row(x: Any) -> Any:
    """A probe row for the batch `x` (a tree of arrays): each input's first row unlike its first row
    (a row alike would tell a mean from a maximum or a variance no better than the first row
    itself), else its first row moved off its values."""
    def other(a: Any) -> Any:
        rows = np.asarray(a)
        unlike = next((i for i in range(1, len(rows)) if not np.array_equal(rows[i], rows[0])), None)
        if unlike is not None:
            return a[unlike:unlike + 1]
        return a[:1] * 1.5 + 0.25 if jnp.issubdtype(a.dtype, jnp.floating) else a[:1]
    return jax.tree.map(other, x)


def check_batch_losses(model: Any, x: Any, replicas: int) -> None:
    """On more than one replica, a layer's `add_loss` term that depends on the batch `x` is refused
    unless it is a mean over the batch's rows (its value on two rows the mean of its values on
    each), which is exact only on batches every replica fills with real rows (a warning says so):
    each replica computes the term on its own rows (padding rows included) and the step takes
    their mean."""
    own_code = [la for la in (model, *_layers(model)) if not defined_in_keras(type(la))]
    if replicas == 1 or not own_code or not jax.eval_shape(lambda x: [v for _, v in _added_losses(model, x)], x):
        return  # Keras' own layers add no loss but their activity regularisers'; a user's may
    first, second = jax.tree.map(lambda a: a[:1], x), _another_row(x)
    both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, second)
    added = [_added_losses(model, r) for r in (first, second, both)]
    one, other, two = ([float(jnp.sum(v)) for _, v in terms] for terms in added)
    for (name, _), a, b, ab in zip(added[0], one, other, two):
        if a == b == ab:  # the same on other rows: not computed from the batch
            continue
        if not np.isclose(ab, (a + b) / 2, rtol=1e-5, atol=1e-7):
            raise ValueError(
                f"layer {name!r} adds a loss computed from the batch (`self.add_loss` in its `call`) that is not a "
                f"mean over the batch's rows: on {replicas} replicas each replica computes it on its own rows, so the "
                "step would not be one device's. Give it as a loss of (y_true, y_pred) in compile(loss=...), or as "
                "an `activity_regularizer` (lockstep counts its real rows, exactly), or train on one replica.")
        warnings.warn(
            f"layer {name!r} adds a loss computed from the batch (a mean over its rows): on {replicas} replicas it is "
            "one device's only on batches every replica fills with real rows; a last short batch, or a batch size "
            f"that is not a multiple of {replicas}, gives another step there. Use a batch size the replicas divide, "
            "and data the batch size divides (or drop the remainder).", UserWarning, stacklevel=4)


@contextlib.contextmanager
def activity_penalties_masked(model: Any) -> Iterator[None]:
    """While tracing a step: every activity regulariser of `model` counts only real rows."""
    originals = [(la, la.activity_regularizer) for la in _layers(model)
                 if getattr(la, "activity_regularizer", None) is not None]
    try:
        for layer, reg in originals:
            layer.activity_regularizer = functools.partial(_masked_penalty, layer, reg)
        yield
    finally:
        for layer, reg in originals:
            layer.activity_regularizer = reg


@contextlib.contextmanager
def layer_outputs_named(model: Any) -> Iterator[None]:
    """While tracing a step: the outputs of each of `model.layers` are named `LAYER_OUTPUT`
    (`jax.ad_checkpoint.checkpoint_name`), so a checkpoint policy can keep them alone."""
    from jax.ad_checkpoint import checkpoint_name

    def named(call: Any) -> Any:
        def call_named(*args: Any, **kwargs: Any) -> Any:
            return jax.tree.map(lambda o: checkpoint_name(o, LAYER_OUTPUT) if isinstance(o, jax.Array) else o,
                                call(*args, **kwargs))
        return call_named

    layers = list(getattr(model, "layers", []))
    try:
        for layer in layers:
            layer.call = named(layer.call)  # an instance attribute over the class's method, for this trace
        yield
    finally:
        for layer in layers:
            vars(layer).pop("call", None)


#: Keras' random functions (JAX backend) whose first argument is the drawn shape
_SHAPED_DRAWS = ("normal", "uniform", "randint", "truncated_normal", "gamma", "binomial", "beta")


class _Rows(NamedTuple):
    """How Keras' draws are made on this thread: a call on `rows` rows, replica `replica` of
    `replicas` (draw the global batch's, take this replica's rows), or (`tile`) each row given the
    first row's values (`check_batch_losses`' probes: a row draws alike in a batch of any rows).
    `seen` lists each draw's first dimension as the call makes them; `following` (from
    `draws_following_rows`) says which draws, in that order, follow the batch's rows; `recording`:
    every draw is Keras' own, only seen; `training`: a training call (where mixing rows counts)."""

    rows: int
    replicas: int
    replica: Any
    tile: bool = False
    following: tuple[bool, ...] | None = None
    seen: list[Any] | None = None
    recording: bool = False
    training: bool = True

    def draw(self, draw: Callable[[tuple[int, ...]], Any], shape: tuple[int, ...]) -> Any:
        if self.tile:
            return jnp.broadcast_to(draw((1, *shape[1:])), shape)
        everyone = draw((self.rows * self.replicas, *shape[1:]))
        return lax.dynamic_slice_in_dim(everyone, self.replica * self.rows, self.rows, axis=0)

    def key(self, seed: Any, row_size: int) -> Any:
        """The key of Keras' draw `seed` (a raw or typed threefry key) that draws this replica's
        rows of the global batch's draw directly (`_ROWS_OF`: its counters start at the replica's
        first element), so a replica generates its own rows' random bits alone."""
        data = jax.random.key_data(seed) if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed
        per = self.rows * row_size  # elements a replica draws; its first is replica * per (64 bits)
        replica = jnp.asarray(self.replica, jnp.uint32)  # < 2**16: each product below fits 32 bits
        low, middle = replica * jnp.uint32(per & 0xFFFF), replica * jnp.uint32((per >> 16) & 0xFFFF)
        lo = low + (middle << 16)
        hi = replica * jnp.uint32(per >> 32) + (middle >> 16) + (lo < low).astype(jnp.uint32)
        return jax.random.wrap_key_data(jnp.concatenate([data.astype(jnp.uint32), jnp.stack([hi, lo])]),
                                        impl=_rows_of())

    def follows(self, shape: Any, *args: Any) -> bool:
        """Whether a draw of `shape` (with `args`) is one of the batch's rows, drawn so: its first
        dimension the rows', no argument an array of the rows' (Keras' own takes those), and
        (where `following` is known) a draw that follows the batch's length."""
        shape = tuple(shape)
        if self.seen is not None:
            self.seen.append(shape[0] if shape else None)
        if self.recording:
            return False
        rows = bool(shape) and shape[0] == self.rows and not any(
            np.ndim(a) and np.shape(a)[0] == self.rows for a in args if hasattr(a, "shape"))
        if self.following is None or self.seen is None or len(self.seen) > len(self.following):
            return rows
        return rows and self.following[len(self.seen) - 1]


def draws_following_rows(model: Any, x: Any, flag: dict[str, Any]) -> tuple[bool, ...] | None:
    """Which of Keras' random draws in a call of `model` on a batch like `x` follow the batch's
    rows, in the order the call makes them: those whose first dimension is the rows' at 2 and at
    3 rows (traced, outside any replica). A draw of a replica's length may be one for the whole
    batch (`Dropout(noise_shape=(1, ...))` on one row a replica) or one per row (`SpatialDropout1D`):
    only its length at another batch size tells. None where the two calls draw differently (a call
    that cannot be traced so): then a draw of the rows' length is taken for the rows'."""
    def seen(n: int) -> list[Any]:
        rows = _Rows(n, 1, 0, seen=[], recording=True)
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *np.shape(a)[1:]), a.dtype), x)
        with _drawing(rows), replica_context(None):
            jax.eval_shape(lambda t, nt, v: model.stateless_call(t, nt, v, **flag),
                           *([jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables]
                             for variables in (model.trainable_variables, model.non_trainable_variables)), like)
        return rows.seen or []
    try:
        two, three = seen(2), seen(3)
        if len(two) == len(three):
            return tuple(a == 2 and b == 3 for a, b in zip(two, three))
        why = "it draws another number of times on 2 rows than on 3"
    except Exception as e:  # noqa: BLE001 (a model that cannot be called at other batch sizes: the length decides)
        why = f"it cannot be called on 2 and 3 rows ({type(e).__name__}: {e})"
    warnings.warn(f"lockstep cannot tell which random draws of model {getattr(model, 'name', '?')!r} follow the "
                  f"batch's rows ({why[:300]}): a draw as long as a replica's rows is taken for the rows' (a mask "
                  "shared by the batch, Dropout(noise_shape=(1, ...)), on one row a replica would then be drawn "
                  "per replica).", UserWarning, stacklevel=2)
    return None


def _rows_of_bits(key: Any, bit_width: int, shape: tuple[int, ...]) -> Any:
    """JAX's partitionable threefry bits (``jax_threefry_partitionable``: element i of a draw gets
    the hash of the 64-bit counter i) with the counters starting at the key's words 2-3."""
    from jax.extend.random import threefry2x32_p

    n = int(np.prod(shape))
    lo = lax.iota(jnp.uint32, n) + key[3]
    hi = jnp.full((n,), key[2], jnp.uint32) + (lo < key[3]).astype(jnp.uint32)
    first, second = threefry2x32_p.bind(key[0], key[1], hi, lo)
    bits = first ^ second
    return (bits if bit_width == 32 else lax.convert_element_type(bits, {8: jnp.uint8, 16: jnp.uint16}[bit_width])
            ).reshape(shape)


def _refused(*_: Any, **__: Any) -> Any:
    raise NotImplementedError("a replica's rows of a random draw are drawn, not split or folded")


@functools.cache
def _rows_of() -> Any:
    """The PRNG implementation of `_Rows.key`: threefry keys (words 0-1) with a first counter
    (words 2-3); `uniform`, `normal`, `bernoulli` and `truncated_normal` draw from its bits."""
    from jax.extend.random import define_prng_impl

    return define_prng_impl(key_shape=(4,), seed=_refused, split=_refused, random_bits=_rows_of_bits,
                            fold_in=_refused, name="lockstep_rows_of")


#: Keras' draws made from a `_Rows.key` (the others draw the global batch's and slice it)
_KEYED_DRAWS = ("normal", "uniform", "truncated_normal")


class _Setting(threading.local):
    rows: _Rows | None = None


_SETTING = _Setting()
_KERAS_OWN: dict[str, Any] = {}  # Keras' own functions, replaced once by wrappers that read `_SETTING`
_INSTALL = threading.Lock()


def _install() -> None:
    """Replaces Keras' random functions (JAX backend) by ones that draw as `_SETTING` says on the
    calling thread (Keras' own where it says nothing), once."""
    from keras.src.backend.jax import random as keras_random
    from keras.src.utils.jax_layer import JaxLayer

    with _INSTALL:
        if _KERAS_OWN:
            return
        own = {name: getattr(keras_random, name) for name in (*_SHAPED_DRAWS, "dropout", "categorical", "shuffle")}
        own["jax_layer_call"] = JaxLayer.call

        def shaped(draw: Any, keyed: bool) -> Any:
            def rows_drawn(shape: Any, *args: Any, **kwargs: Any) -> Any:
                rows = _SETTING.rows
                if rows is None or not rows.follows(shape, *args, *kwargs.values()):
                    return draw(shape, *args, **kwargs)
                if keyed and not rows.tile and kwargs.get("seed") is not None:
                    seed = rows.key(keras_random.jax_draw_seed(kwargs["seed"]), int(np.prod(tuple(shape)[1:])))
                    return draw(shape, *args, **{**kwargs, "seed": seed})
                return rows.draw(lambda s: draw(s, *args, **kwargs), tuple(shape))
            return rows_drawn

        def dropout(inputs: Any, rate: float, noise_shape: Any = None, seed: Any = None) -> Any:
            rows = _SETTING.rows
            noise = tuple(keras_random._get_concrete_noise_shape(inputs, noise_shape))
            if rows is None or rate in (0.0, 1.0) or not rows.follows(noise):
                return own["dropout"](inputs, rate, noise_shape, seed)
            if not rows.tile and seed is not None:
                key = rows.key(keras_random.jax_draw_seed(seed), int(np.prod(noise[1:])))
                return own["dropout"](inputs, rate, noise_shape, key)
            kept = rows.draw(lambda s: own["dropout"](jnp.ones(s, inputs.dtype), rate, None, seed) != 0, noise)
            return lax.select(jnp.broadcast_to(kept, inputs.shape), inputs / (1.0 - rate), jnp.zeros_like(inputs))

        def categorical(logits: Any, num_samples: int, dtype: str = "int32", seed: Any = None) -> Any:
            rows = _SETTING.rows
            if rows is None or rows.tile or not rows.follows(logits.shape):
                return own["categorical"](logits, num_samples, dtype, seed)
            everyone = jnp.zeros((rows.rows * rows.replicas, *logits.shape[1:]), logits.dtype)  # others: not read
            placed = lax.dynamic_update_slice_in_dim(everyone, logits, rows.replica * rows.rows, 0)
            return lax.dynamic_slice_in_dim(own["categorical"](placed, num_samples, dtype, seed),
                                            rows.replica * rows.rows, rows.rows, axis=0)

        def shuffle(x: Any, axis: int = 0, seed: Any = None) -> Any:
            rows = _SETTING.rows
            if (rows is not None and axis % max(np.ndim(x), 1) == 0 and rows.follows(np.shape(x)) and rows.training
                    and not rows.tile):
                raise ValueError(
                    f"keras.random.shuffle permutes the batch's rows (MixUp, CutMix, or a layer of yours) inside the "
                    f"model, on {rows.replicas} replicas: one device permutes the whole batch, a replica here only "
                    "its own rows, so the step would not be the one-device step. Mix the rows in the input pipeline "
                    "(a tf.data or Grain map over whole batches) or train on one replica.")
            return own["shuffle"](x, axis, seed)

        for name in _SHAPED_DRAWS:
            setattr(keras_random, name, shaped(own[name], name in _KEYED_DRAWS))
        keras_random.dropout, keras_random.categorical, keras_random.shuffle = dropout, categorical, shuffle
        JaxLayer.call = refusing_drawn_calls(own["jax_layer_call"], _replicas_drawing)
        _KERAS_OWN.update(own)


def _replicas_drawing() -> int:
    """The replicas whose draws this thread's call makes as one device's (1: Keras' own draws)."""
    rows = _SETTING.rows
    return 1 if rows is None or rows.recording or rows.tile else rows.replicas


@contextlib.contextmanager
def _drawing(rows: _Rows | None) -> Iterator[None]:
    _install()
    previous, _SETTING.rows = _SETTING.rows, rows
    try:
        yield
    finally:
        _SETTING.rows = previous


def random_draws_as_one_device(rows: int, following: tuple[bool, ...] | None = None, training: bool = True) -> Any:
    """While tracing a replica's call on its `rows` rows: Keras' random draws are the global
    batch's, this replica's rows of them (see the module docstring; a draw given arrays of the
    rows is Keras' own; `following`: which draws follow the rows, from `draws_following_rows`).
    Outside a replica, or on one, Keras' own.

    Raises (while the call is traced, on several replicas):
      ValueError: a training call shuffles the batch's rows (`keras.random.shuffle`: MixUp,
        CutMix), or a `JaxLayer` / `FlaxLayer` draws with its `rng` (`_jax_layers`).
    """
    ctx = get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return contextlib.nullcontext()
    if not jax.config.jax_threefry_partitionable:
        warnings.warn("jax_threefry_partitionable is off: a row's random draws then depend on the batch's length, "
                      "so lockstep's replicas draw other dropout masks and noise than one device would.",
                      UserWarning, stacklevel=3)
    return _drawing(_Rows(rows, ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group, following=following,
                          seen=None if following is None else [], training=training))
