"""`lockstep launch`: a local multi-process launcher."""

from ._launcher import free_port as free_port
from ._launcher import launch as launch

__all__ = ["free_port", "launch"]
