"""`GlobalOrders`: the sample order of each pass over in-memory arrays drawn as Keras' own `fit`
draws it, from NumPy's global random state (``np.random.permutation``) when the pass begins, so
that a script seeded with `keras.utils.set_random_seed` shuffles as it does in Keras alone.

With several workers, worker 0's draw is every worker's (each worker's own global state moves on
as its own draw moves it, as in Keras). For backups, `state` says where NumPy's global state stood
before the pass in progress was drawn, and where it stands now; `restore` draws that pass again
from the first and leaves NumPy's global state at the second, so a resumed `fit` shuffles on as
the uninterrupted one does.

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

from typing import Any

import numpy as np

from ..engine import broadcast_from_chief


def _to_json(state: Any) -> dict[str, Any] | None:
    if state is None:
        return None
    kind, keys, pos, has_gauss, gauss = state
    return {"kind": kind, "keys": np.asarray(keys).tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def _from_json(d: dict[str, Any]) -> tuple[Any, ...]:
    return (d["kind"], np.asarray(d["keys"], np.uint32), int(d["pos"]), int(d["has_gauss"]), float(d["gauss"]))


class GlobalOrders:
    """The order of each pass over `n` samples, drawn from NumPy's global random state (worker 0's)."""

    def __init__(self, n: int):
        self._n = n
        self._drawn: tuple[int, Any, np.ndarray] | None = None  # (pass, the global state before its draw, its order)

    def order(self, pass_index: int) -> np.ndarray:
        """The order of pass `pass_index`: drawn when first asked for (a collective with several
        workers: every worker asks at the start of the same pass)."""
        if self._drawn is None or self._drawn[0] != pass_index:
            before = np.random.get_state()
            order = np.asarray(broadcast_from_chief(np.random.permutation(self._n)))
            self._drawn = (pass_index, before, order)
        return self._drawn[2]

    def state(self, pass_index: int) -> dict[str, Any]:
        """For a backup at pass `pass_index`: NumPy's global state before that pass was drawn (None:
        not drawn yet) and now."""
        drawn = self._drawn if self._drawn is not None and self._drawn[0] == pass_index else None
        return {"before": _to_json(None if drawn is None else drawn[1]), "now": _to_json(np.random.get_state())}

    def restore(self, pass_index: int, state: dict[str, Any]) -> None:
        """Takes up a backup's `state` at pass `pass_index`: that pass drawn again as it was, and
        NumPy's global state where it stood at the backup."""
        self._drawn = None
        if state.get("before") is not None:
            np.random.set_state(_from_json(state["before"]))
            self.order(pass_index)
        np.random.set_state(_from_json(state["now"]))
