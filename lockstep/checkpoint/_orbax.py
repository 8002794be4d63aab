"""Training-state checkpoints on orbax-checkpoint: multi-process JAX arrays, atomic commits.

A checkpoint is a step directory holding two items: ``arrays`` (a flat dict of arrays, each
worker writing the shards it holds) and ``meta`` (JSON). Orbax writes into a temporary
directory and renames it when complete, so a reader only ever sees whole checkpoints.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import numpy as np


_TRASH = "trash"


class TrainingCheckpointer:
    """Numbered checkpoints in `directory`; keeps the newest `max_to_keep`.

    >>> import tempfile, numpy as np, lockstep.checkpoint as ck
    >>> c = ck.TrainingCheckpointer(tempfile.mkdtemp())
    >>> c.save(3, {"w": np.arange(4.0)}, {"epoch": 1})
    >>> step = c.latest_step(); arrays, meta = c.restore(step)
    >>> step, arrays["w"].tolist(), meta["epoch"]
    (3, [0.0, 1.0, 2.0, 3.0], 1)
    """

    def __init__(self, directory: str | os.PathLike[str], max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        # Deleting a step in place is not atomic (a kill midway leaves a listed, broken step), so
        # old steps are first renamed into a trash folder, which is purged separately.
        self._trash = os.path.join(self.directory, _TRASH)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False,
                                               cleanup_tmp_directories=True, create=True, todelete_subdir=_TRASH)
        handlers = {"arrays": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete checkpoint's step, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Writes checkpoint `step` (every worker calls this together); returns when it is committed."""
        args = self._ocp.args
        self._manager.save(step, args=args.Composite(arrays=args.StandardSave(arrays), meta=args.JsonSave(meta)),
                           force=True)
        self._manager.wait_until_finished()
        self._purge()

    def _purge(self) -> None:
        if jax.process_index() == 0:
            shutil.rmtree(self._trash, ignore_errors=True)

    def restore(self, step: int, shardings: dict[str, Any] | None = None, default_sharding: Any = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The arrays and the JSON of checkpoint `step`.

        Each array is placed with `shardings[name]`, else `default_sharding`; with neither it
        comes back as NumPy (single process only).
        """
        args = self._ocp.args
        shardings = shardings or {}
        saved = self._manager.item_metadata(step)["arrays"]
        if not shardings and default_sharding is None:
            target = args.StandardRestore()
        else:
            target = args.StandardRestore({
                k: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=shardings.get(k, default_sharding))
                for k, m in saved.items()})
        out = self._manager.restore(step, args=args.Composite(arrays=target, meta=args.JsonRestore()))
        arrays = dict(out["arrays"])
        if not shardings and default_sharding is None:
            arrays = {k: np.asarray(v) for k, v in arrays.items()}
        return arrays, dict(out["meta"])

    def delete_all(self) -> None:
        """Removes every checkpoint (the chief deletes; every worker waits for it)."""
        # the steps this manager saved or read, not a fresh listing: a worker listing the directory
        # after the chief's first deletion would call `delete` fewer times, and orbax's barriers in
        # `delete` would then pair different calls on different workers (a flaky failure)
        for step in self._manager.all_steps():
            self._manager.delete(step)
        self._manager.wait_until_finished()
        self._purge()

    def close(self) -> None:
        self._manager.close()


