"""Prefetching: global batches prepared (sliced, padded, placed) ahead of the step that uses them,
in a background thread, so host work overlaps device work."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import jax


#: Global batches prepared (sliced, padded, placed on the devices) ahead of the step that uses
#: them, in a background thread, so host work overlaps device work. 0 turns it off; unset, it is
#: 2 on accelerators and 0 on CPU devices, where the "device" work runs on the same cores and a
#: second Python thread only contends for them (and for the GIL).
PREFETCH = os.environ.get("LOCKSTEP_PREFETCH")


def prefetch_depth(devices: Iterable[jax.Device]) -> int:
    if PREFETCH is not None:
        return int(PREFETCH)
    return 0 if all(d.platform == "cpu" for d in devices) else 2


_DONE = object()


def prefetch(source: Iterator[Any], depth: int) -> Iterator[Any]:
    """Runs `source` in a background thread, `depth` items ahead; errors surface in the consumer."""
    items: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        items.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put((True, _DONE))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            items.put((False, e))

    thread = threading.Thread(target=produce, name="lockstep-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = items.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=5.0)
