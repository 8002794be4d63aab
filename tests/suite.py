"""What `make test` runs of a parametrized test, and what only `make test-full` adds (CI time)."""

import os

import pytest

FULL = os.environ.get("LOCKSTEP_FULL_SUITE") == "1"


def variants(values, in_make_test):
    """`values` for `pytest.mark.parametrize`: those not in `in_make_test` run in `make test-full` only.

    >>> [getattr(v, "values", v) for v in variants([1, 2, 3], {2})]
    [(1,), 2, (3,)]
    """
    return [v if v in in_make_test else pytest.param(*(v if isinstance(v, tuple) else (v,)),
                                                      marks=pytest.mark.full_suite) for v in values]
