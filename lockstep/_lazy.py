"""`lazy_exports`: a package's `__getattr__` that imports the module defining a name when the name
is first asked for (PEP 562), so a package can export what other packages use without importing
JAX when it is itself imported (`lockstep launch` starts without JAX). Standard library only.

>>> getattr_ = lazy_exports("json", {"dumps": ""})
>>> getattr_("dumps")([1])
'[1]'
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`, whose name `n` is `exports[n]`'s (a module of the package)."""
    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{exports[name]}" if exports[name] else package), name)
    return __getattr__
