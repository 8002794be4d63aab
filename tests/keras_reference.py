"""Comparisons with an independent one-device run (Keras' own `fit`, a hand-written loop), shared
by the tests of Keras code as written and of the engine."""

import jax
import numpy as np


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
