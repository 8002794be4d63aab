"""`batches`: global batches from in-memory arrays."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..engine import (BatchRows, ResidentBatch, ResidentPass, fits_on_devices, padded_per_replica, place_ahead,
                      place_whole)
from ._adapter import DataAdapter
from ._global_orders import GlobalOrders

if TYPE_CHECKING:
    from ..engine import Engine


class Batches(DataAdapter):
    """A re-iterable sequence of global batches over a pytree of arrays.

    Made by `lockstep.data.batches`. With `shuffle=True` each pass over the data uses a new
    permutation, drawn from `seed` and the number of the pass, so runs are reproducible (with
    `seed=None`, from NumPy's global random state as the pass begins, as Keras' `fit` draws it:
    `GlobalOrders`). With `shuffle="batch"` (Keras' on JAX: the rows inside each batch permuted)
    the batches and their rows keep their order, as a batch's sums do not depend on its rows'
    order; with `seed=None` each batch `fit` takes draws the permutation Keras' `fit` draws for it
    from NumPy's global random state (`taken`), so later draws are Keras'. `fit`
    reads in-memory arrays a pass ahead (placing the next while one trains): change them between
    fits, not from a callback during one.
    """

    by_index = True

    def __init__(self, arrays: Any, batch_size: int, shuffle: bool | str, seed: int | None, drop_remainder: bool):
        self.arrays = arrays
        self._leaves, self._treedef = jax.tree.flatten(arrays)
        self._n = int(np.shape(self._leaves[0])[0])
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.epoch = 0
        self._shuffled = shuffle is True  # ("batch": in order)
        # Keras' draws from NumPy's global state: each pass's order, or ("batch") each batch's rows' (unused)
        self._keras_draws = GlobalOrders(self._n) if shuffle and seed is None else None
        self._global = self._keras_draws if self._shuffled else None
        # (engine, pass, start, placing, the order it is placed in where drawn from NumPy's global state)
        self._next_pass: tuple[Any, int, int, Future[ResidentPass], Any] | None = None
        self._whole: tuple[Any, tuple[jax.Array, ...] | None] | None = None  # (engine, `place_whole`'s arrays)

    @property
    def num_samples(self) -> int:
        return self._n

    def __len__(self) -> int:
        full, rest = divmod(self._n, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of pass number `epoch`."""
        if not self._shuffled:
            return np.arange(self._n)
        if self._global is not None:
            return self._global.order(epoch)
        return np.random.default_rng([self.seed, epoch]).permutation(self._n)

    def order_state(self, epoch: int) -> dict[str, Any] | None:
        if self._keras_draws is None:
            return None
        return self._keras_draws.state(epoch)

    def restore_order(self, epoch: int, state: dict[str, Any]) -> None:
        if self._keras_draws is not None:
            self._keras_draws.restore(epoch, state)

    def taken(self, epoch: int, index: int) -> None:
        if self._keras_draws is not None and self._global is None:  # Keras' draw for this batch's rows
            np.random.permutation(min(self.batch_size, self._n - index * self.batch_size))

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """Batches of pass number `epoch`, from batch index `start` on (whole: every row read)."""
        for batch in self.rows(epoch, start):
            yield batch.read(0, batch.num_real)

    def __iter__(self) -> Iterator[Any]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self.iterate(epoch)

    def first(self) -> Any:
        if self._global is not None:  # its shapes, without drawing a pass's order from NumPy's global state
            return self._batch_rows(np.arange(self._n), 0).read(0, min(self.batch_size, self._n))
        return next(self.iterate(0), None)

    def whole(self) -> Any:
        return self.arrays

    def host_pass(self, epoch: int | None, start: int = 0, state: str | None = None) -> Iterator[BatchRows]:
        """Pass `epoch` (None: the next, as `iter()` counts them) as `rows`: each worker reads its rows."""
        if epoch is None:
            epoch, self.epoch = self.epoch, self.epoch + 1
        return self.rows(epoch, start)

    def rows(self, epoch: int, start: int = 0) -> Iterator[BatchRows]:
        """Batches of pass `epoch` from batch `start` on, each read only where a worker needs rows."""
        order = self.order(epoch)
        return (self._batch_rows(order, i) for i in range(start, len(self)))

    def _batch_rows(self, order: np.ndarray, i: int) -> BatchRows:
        """Batch `i` of the pass whose sample order is `order`."""
        lo, hi = i * self.batch_size, min((i + 1) * self.batch_size, self._n)

        def read(a: int, b: int) -> Any:
            if not self._shuffled:
                return jax.tree.unflatten(self._treedef, [leaf[lo + a:lo + b] for leaf in self._leaves])
            return jax.tree.unflatten(self._treedef, [np.take(leaf, order[lo + a:lo + b], axis=0)
                                                      for leaf in self._leaves])
        return BatchRows(hi - lo, read, lambda: read(0, 1))

    def resident_pass(self, engine: "Engine", epoch: int, start: int = 0,
                      ahead: bool = False) -> Iterator[ResidentBatch] | None:
        """Pass `epoch` from batch `start` as batches whose rows lie on `engine`'s devices (the
        pass is placed at once, each replica's rows on its devices; one replica's indexes a copy of
        the arrays placed once a fit), every batch padded to the full batch's shape; None when the
        arrays are too large to place a pass of at once.
        `ahead`: the next pass (`epoch + 1` from its start) is placed in the background meanwhile,
        and a later call for it takes it (without shuffling every pass is the same: it is kept)."""
        if not fits_on_devices(self._leaves):
            return None
        pass_of = (lambda e: e) if self._shuffled else (lambda e: 0)
        if self._whole is None or self._whole[0] is not engine:  # on this thread: `release` lets it go
            self._whole = (engine, place_whole(engine.distributor, self._leaves))
        whole_data = self._whole[1]
        waiting, self._next_pass = self._next_pass, None
        drawn = None if self._global is None else self._global.order(epoch)  # drawn as the pass begins
        whole = None
        if (waiting is not None and waiting[0] is engine and waiting[1:3] == (pass_of(epoch), start)
                and (drawn is None or np.array_equal(drawn, waiting[4]))):  # placed ahead in the order drawn
            try:
                whole = waiting[3].result()
            except Exception:  # placed again below: an error that stays is raised on this thread
                whole = None
        elif waiting is not None:
            waiting[3].cancel()
        if whole is None:
            whole = self._place_pass(engine, epoch, start, whole_data)
        if ahead and (pass_of(epoch + 1), 0) == (pass_of(epoch), start):
            done: Future[ResidentPass] = Future()
            done.set_result(whole)
            self._next_pass = (engine, pass_of(epoch), start, done, None)
        elif ahead:  # a pass drawn from NumPy's global state: placed in the order its draw will give if
            # nothing else draws from that state meanwhile (else placed again when it begins)
            order = None if self._global is None else self._global.peek()
            self._next_pass = (engine, pass_of(epoch + 1), 0,
                               place_ahead(lambda: self._place_pass(engine, epoch + 1, 0, whole_data, order)), order)
        return (whole.batch(i) for i in range(len(whole)))

    def release(self) -> None:
        """Lets go of the pass placed ahead, if any (its device memory): `fit` calls it as it ends,
        so that a later `fit` reads the arrays again."""
        waiting, self._next_pass, self._whole = self._next_pass, None, None
        if waiting is not None:
            waiting[3].cancel()

    def new_fit(self) -> None:
        if self._keras_draws is not None:
            self._keras_draws.forget()

    def _place_pass(self, engine: "Engine", epoch: int, start: int, whole: Any,
                    order: np.ndarray | None = None) -> ResidentPass:
        order, b = self.order(epoch) if order is None else order, self.batch_size
        padded = padded_per_replica(b, engine.num_replicas) * engine.num_replicas
        return ResidentPass(engine.distributor, self._leaves, self._treedef,
                            [order[i * b:(i + 1) * b] for i in range(start, len(self))], padded,
                            lambda i: self._batch_rows(order, start + i), whole)


def batches(arrays: Any, batch_size: int, shuffle: bool | str = False, seed: int | None = 0,
            drop_remainder: bool = False) -> Batches:
    """Yields global batches of `batch_size` samples from a pytree of arrays.

    Args:
      arrays: an array, or a pytree (tuple, dict, ...) of arrays sharing their first dimension.
      batch_size: global batch size (all replicas and workers together), at least 1.
      shuffle: draw a new permutation on every pass over the data; ``"batch"``: Keras'
        ``shuffle="batch"``, the same sums as in order (see `Batches`).
      seed: seed of the permutations; None: each pass's drawn from NumPy's global random state as
        the pass begins (``np.random.permutation``, worker 0's on every worker), as Keras' `fit` draws it.
      drop_remainder: leave out a last batch shorter than `batch_size`.

    Returns:
      A re-iterable `Batches`; `len()` is the number of batches per pass.

    Raises:
      ValueError: `batch_size` is not positive, `shuffle` is a string other than ``"batch"``, the
        arrays have different lengths, or no samples.

    >>> import lockstep as ls, numpy as np
    >>> b = ls.data.batches((np.arange(5), np.arange(5) * 10), batch_size=2)
    >>> len(b), [x.tolist() for x, y in b]
    (3, [[0, 1], [2, 3], [4]])
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got batch_size={batch_size!r}.")
    if isinstance(shuffle, str) and shuffle != "batch":  # Keras would take a misspelt "batch" as True
        raise ValueError(f"`shuffle` must be True, False or 'batch' (as in Keras), got shuffle={shuffle!r}.")
    leaves = jax.tree.leaves(arrays)
    if not leaves:
        raise ValueError(f"`arrays` must hold at least one array, got {arrays!r}.")
    leaves = [np.asarray(x) for x in leaves]
    if any(x.ndim == 0 for x in leaves):
        raise ValueError("every array in `arrays` needs a first (sample) dimension, got a scalar.")
    lengths = [int(x.shape[0]) for x in leaves]
    if len(set(lengths)) != 1:
        raise ValueError(f"every array in `arrays` must have the same length, got lengths {lengths}.")
    if lengths[0] == 0:
        raise ValueError("`arrays` hold no samples (length 0).")
    return Batches(jax.tree.unflatten(jax.tree.structure(arrays), leaves), int(batch_size),
                   shuffle if shuffle == "batch" else bool(shuffle), None if seed is None else int(seed),
                   bool(drop_remainder))
