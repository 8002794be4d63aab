"""Atomic file writes and a plain pytree-of-arrays file format (NumPy `.npz`)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

import jax
import numpy as np


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yields a temporary path beside `path`; on success it is fsynced and renamed onto `path`.

    A crash at any moment leaves either the previous file or the new one, never a partial file.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp" + os.path.splitext(base)[1], dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """Writes `path` atomically with `write(file)`."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()


def save_tree(path: str | os.PathLike[str], tree: Any, **extra: Any) -> None:
    """Saves a pytree of arrays (plus scalar `extra` entries) atomically as `.npz`.

    >>> import lockstep.checkpoint as ck, numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "w.npz")
    >>> ck.save_tree(p, {"a": np.arange(3), "b": [np.ones(2)]}, epoch=4)
    >>> tree, extra = ck.load_tree(p, like={"a": 0, "b": [0]})
    >>> tree["a"].tolist(), int(extra["epoch"])
    ([0, 1, 2], 4)
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    arrays = {f"leaf/{i:05d}/{jax.tree_util.keystr(p)}": np.asarray(v) for i, (p, v) in enumerate(leaves)}
    arrays.update({f"extra/{k}": np.asarray(v) for k, v in extra.items()})
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write(path, lambda f: f.write(buf.getvalue()))


def load_tree(path: str | os.PathLike[str], like: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Loads what `save_tree` wrote into the structure of `like`.

    Raises:
      ValueError: the file holds another number of arrays than `like` has leaves.
    """
    with np.load(os.fspath(path)) as data:
        names = sorted(k for k in data.files if k.startswith("leaf/"))
        leaves = [data[k] for k in names]
        extra = {k.removeprefix("extra/"): data[k] for k in data.files if k.startswith("extra/")}
    treedef = jax.tree.structure(like)
    if treedef.num_leaves != len(leaves):
        raise ValueError(f"`{os.fspath(path)}` holds {len(leaves)} arrays, but the model has {treedef.num_leaves}.")
    return jax.tree.unflatten(treedef, leaves), extra
