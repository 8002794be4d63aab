"""Keras' own runs as the tests' references, and comparisons with an independent one-device run
(Keras' own `fit`, a hand-written loop), shared by the tests of Keras code as written, of the
engine and of sharded models.

A reference is Keras code as written: `keras_fit` builds, compiles and fits a model with Keras
alone (one device) or in a lockstep strategy's scope (lockstep runs it); `in_keras_and_lockstep`
runs any such code both ways.
"""

import contextlib

import jax
import keras
import numpy as np


def built(build, strategy=None, seed=None):
    """`build()`'s model, made in `strategy`'s scope (None: Keras alone), after
    `keras.utils.set_random_seed(seed)` where `seed` is given."""
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        if seed is not None:
            keras.utils.set_random_seed(seed)
        return build()


def keras_fit(build, x, y, strategy=None, seed=None, compile=None, **fit_kwargs):
    """Keras' `fit` of `build()`'s model (`built`), compiled in the same scope with `compile` (the
    keyword arguments of `model.compile`, or a function that gives them, called there: a Keras
    optimizer made in the scope, as Keras code as written makes it; None: as `build` left it), in
    order and silently: (its weights, its history). With no `strategy`, Keras' own one-device fit:
    the reference."""
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = built(build, seed=seed)
        if compile is not None:
            model.compile(**(compile() if callable(compile) else compile))
    history = model.fit(x, y, shuffle=False, verbose=0, **fit_kwargs)
    return model.get_weights(), history.history


def in_keras_and_lockstep(build, run, strategy):
    """`run(model)` of a model made (and compiled) by `build()` with Keras alone, then in
    `strategy`'s scope: (Keras' result and weights, lockstep's result and weights). `run` may take
    a second argument: whether lockstep runs the model."""
    out = []
    for where in (None, strategy):
        model = built(build, where)
        result = run(model, where is not None) if run.__code__.co_argcount == 2 else run(model)
        out.append((result, [np.asarray(w) for w in model.get_weights()]))
    return out


def assert_logs_close(got, want, rtol=1e-5, atol=1e-6):
    """The same log names, and every value (a number or a per-epoch list) within float32 tolerance."""
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


def assert_weights_close(a, b, atol=1e-6):
    """Every array of `a` within `atol` of the matching array of `b`."""
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=0, atol=atol)


def assert_equals_one_device(got, want, rtol=2e-5, atol=2e-6):
    """`got` and `want` are (weights, logs) of a run on several devices and of an independent
    one-device reference: the same weights (within `atol`) and logs (within `rtol`)."""
    assert_logs_close(got[1], want[1], rtol=rtol, atol=atol)
    assert_weights_close(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), atol=atol)
