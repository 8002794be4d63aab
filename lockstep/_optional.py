"""Optional dependencies: imported where a feature needs them, with an error that names the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """`module`, imported; if it is missing, an ImportError that says which extra installs it.

    >>> require("json", "none", "a doctest").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{feature} needs `{module.split('.')[0]}`, which is not installed: "
                          f"pip install 'lockstep[{extra}]'.") from e
