"""The tests' markers and what is not a test module (the 8 simulated CPU devices and Keras on JAX
are set by the repository's root `conftest.py`, for doctests and tests alike)."""

import os

import pytest

# scripts that worker processes run (started by the multi-process tests), not test modules
collect_ignore = ["workers"]


def pytest_configure(config):
    config.addinivalue_line("markers", "full_suite: a costly variant run by `make test-full` only "
                                       "(LOCKSTEP_FULL_SUITE=1), kept out of `make test`'s time budget")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LOCKSTEP_FULL_SUITE") == "1":
        return
    skip = pytest.mark.skip(reason="costly variant: `make test-full` runs it (LOCKSTEP_FULL_SUITE=1)")
    for item in items:
        if "full_suite" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The resume job's uninterrupted result per number of workers (`launching.Uninterrupted`), run once."""
    from launching import Uninterrupted

    return Uninterrupted(tmp_path_factory)
