"""`BackgroundWriter`: writes that run on a thread of their own while training goes on, one at a
time, in the order they were handed over; a failed write's error is raised by the next `wait`.

>>> import os, tempfile, numpy as np
>>> from lockstep.checkpoint import save_tree
>>> writer = BackgroundWriter("doc-writer")
>>> path = os.path.join(tempfile.mkdtemp(), "w.npz")
>>> writer.submit(save_tree, path, {"w": np.arange(3.0)})   # returns before the file is written
>>> writer.wait(); os.path.exists(path)
True
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class BackgroundWriter:
    """Runs `submit`ted writes on one background thread (named after `name`), one in flight: a
    `submit` first waits for the write before it (and raises its error)."""

    def __init__(self, name: str):
        self._name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Any] | None = None

    def submit(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Starts `write(*args, **kwargs)` in the background once the write before it ended. The
        arguments are the caller's no more: they must not change until the write ends."""
        self.wait()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self._name)
        self._pending = self._pool.submit(write, *args, **kwargs)

    def wait(self) -> None:
        """Returns when every write handed over has ended; raises the error of one that failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def shutdown(self) -> None:
        """Waits for the writes handed over and ends the thread (a later `submit` starts another)."""
        try:
            self.wait()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown()
