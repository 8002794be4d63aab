"""Comparisons with Keras' own one-device run, shared by the tests of Keras code as written."""

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
