"""`GlobalOrders`: the order of each pass drawn as Keras' own `fit` draws it when the pass begins:
a permutation of the samples of in-memory arrays from NumPy's global random state
(``np.random.permutation``), or of the batches of a `keras.utils.PyDataset` from Python's
(``random.shuffle``). So a script seeded with `keras.utils.set_random_seed` shuffles as it does in
Keras alone.

With several workers, worker 0's draw is every worker's (each worker's own global state moves on
as its own draw moves it, as in Keras; a resume sets every worker's to worker 0's, which the
backup holds: the orders are worker 0's as uninterrupted). For backups, `state` says where the global state stood
before the pass in progress was drawn, and where it stands now; `restore` draws that pass again
from the first and leaves the global state at the second, so a resumed `fit` shuffles on as the
uninterrupted one does.

>>> import numpy as np
>>> orders = GlobalOrders(5)
>>> np.random.seed(0); first = orders.order(0).tolist()
>>> np.random.seed(0); first == np.random.permutation(5).tolist()
True
>>> saved = orders.state(0); later = np.random.permutation(5).tolist()
>>> orders.restore(0, saved); orders.order(0).tolist() == first, np.random.permutation(5).tolist() == later
(True, True)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from ..engine import broadcast_from_chief


def _python_order(n: int) -> list[int]:
    order = list(range(n))
    random.shuffle(order)
    return order


def _numpy_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"kind": kind, "keys": np.asarray(keys).tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def _set_numpy_state(d: dict[str, Any]) -> None:
    np.random.set_state((d["kind"], np.asarray(d["keys"], np.uint32), int(d["pos"]), int(d["has_gauss"]),
                         float(d["gauss"])))


def _python_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": list(internal), "gauss": gauss}


def _set_python_state(d: dict[str, Any]) -> None:
    random.setstate((d["version"], tuple(d["internal"]), d["gauss"]))


#: how each global random state draws a pass's order, reads its state (as JSON) and sets it
_SOURCES = {"numpy": (np.random.permutation, _numpy_state, _set_numpy_state),
            "python": (_python_order, _python_state, _set_python_state)}


class GlobalOrders:
    """The order of each pass over `n` items, drawn from NumPy's (`source` "numpy") or Python's
    ("python") global random state, worker 0's on every worker."""

    def __init__(self, n: int, source: str = "numpy"):
        self._n = n
        self._draw, self._get, self._set = _SOURCES[source]
        self._drawn: tuple[int, Any, np.ndarray] | None = None  # (pass, the global state before its draw, its order)

    def order(self, pass_index: int) -> np.ndarray:
        """The order of pass `pass_index`: drawn when first asked for (a collective with several
        workers: every worker asks at the start of the same pass)."""
        if self._drawn is None or self._drawn[0] != pass_index:
            before = self._get()
            order = np.asarray(broadcast_from_chief(np.asarray(self._draw(self._n), np.int64)))
            self._drawn = (pass_index, before, order)
        return self._drawn[2]

    def forget(self) -> None:
        """A new `fit`: the next ask for any pass draws it anew (Keras draws every pass)."""
        self._drawn = None

    def peek(self) -> np.ndarray:
        """The order the next pass drawn will have if nothing draws from the global state before it
        begins (drawn, and the state put back where it stood: it does not move), to place that pass ahead
        (worker 0's; a collective). The pass's own draw says whether it is.

        >>> orders = GlobalOrders(6); np.random.seed(1)
        >>> ahead = orders.peek(); bool((orders.order(3) == ahead).all())
        True
        """
        now = self._get()
        try:
            return np.asarray(broadcast_from_chief(np.asarray(self._draw(self._n), np.int64)))
        finally:
            self._set(now)

    def state(self, pass_index: int) -> dict[str, Any]:
        """For a backup at pass `pass_index`: the global state before that pass was drawn (None: not
        drawn yet) and now (JSON)."""
        drawn = self._drawn if self._drawn is not None and self._drawn[0] == pass_index else None
        return {"before": None if drawn is None else drawn[1], "now": self._get()}

    def restore(self, pass_index: int, state: dict[str, Any]) -> None:
        """Takes up a backup's `state` at pass `pass_index`: that pass drawn again as it was, and the
        global state where it stood at the backup."""
        self._drawn = None
        if state.get("before") is not None:
            self._set(state["before"])
            self.order(pass_index)
        self._set(state["now"])
