"""`lockstep launch`: a local multi-process launcher (imports no JAX)."""

from ._launcher import launch as launch

__all__ = ["launch"]
