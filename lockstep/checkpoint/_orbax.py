"""Training-state checkpoints on orbax-checkpoint: multi-process JAX arrays, atomic commits,
checksums.

A checkpoint is a step directory holding two items: ``arrays`` (a flat dict of arrays, each
worker writing the shards it holds) and ``meta`` (JSON). Orbax writes into a temporary
directory and renames it when complete, so a reader only ever sees whole checkpoints. With
`async_save` a save returns at once and the write goes on in the background while training
continues: in one process a writer thread takes the arrays as they are (JAX arrays do not change;
host arrays are copied), copies them to the host one by one, checksums and writes them; with
several workers, orbax's async checkpointing copies them off the devices first (its barriers and
the checksums of arrays spread over workers are collectives, which stay on the training thread).
The rename still comes last, so a process killed while writing leaves the previous checkpoint the
newest. The meta also holds a CRC-32 of every array and of the rest of the meta, checked on
restore: a checkpoint damaged on disk afterwards (truncated, bit-flipped, zeroed, garbled) is
reported as `DamagedCheckpointError`, never restored.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

import jax
import numpy as np

from ..engine import host_value
from ._writer import BackgroundWriter


_TRASH = "trash"
#: Where `set_aside` moves damaged checkpoints, inside the checkpoint directory.
DAMAGED = "damaged"
_CHECKSUMS = "checksums"


class DamagedCheckpointError(RuntimeError):
    """A checkpoint cannot be read back as it was written (`step`: which; the message says why)."""

    def __init__(self, step: int, why: str):
        super().__init__(f"checkpoint {step} is damaged: {why}")
        self.step, self.why = step, why


def _crc(value: np.ndarray) -> str:
    # the dtype JAX restores it as: a host int64 / float64 comes back 32-bit when x64 is off
    value = np.ascontiguousarray(value, dtype=jax.dtypes.canonicalize_dtype(value.dtype))
    head = f"{value.dtype.str}{list(value.shape)}".encode()
    return f"{zlib.crc32(value.view(np.uint8).reshape(-1), zlib.crc32(head)):08x}"


def _meta_crc(meta: dict[str, Any]) -> str:
    as_read = json.loads(json.dumps(meta))  # as the JSON reads back: keys strings, tuples lists
    return f"{zlib.crc32(json.dumps(as_read, sort_keys=True).encode()):08x}"


def checksums(arrays: dict[str, Any], meta: dict[str, Any], primary_only: bool = False) -> dict[str, str]:
    """CRC-32 of every array (its dtype, shape and bytes) and of `meta` (as sorted JSON).
    `primary_only`: worker 0 alone reads arrays it holds whole (only its sums are written); an
    array spread over workers is gathered by all (a collective every worker takes part in).

    >>> import numpy as np
    >>> sums = checksums({"w": np.arange(3.0)}, {"epoch": 1})
    >>> sorted(sums), sums == checksums({"w": np.arange(3.0)}, {"epoch": 1})
    (['meta', 'w'], True)
    >>> checksums({"w": np.array([0.0, 1.0, 2.5])}, {"epoch": 1})["w"] == sums["w"]
    False
    """
    skip = primary_only and jax.process_index() != 0
    out = {}
    for k, v in sorted(arrays.items()):
        spread = isinstance(v, jax.Array) and not v.is_fully_addressable and not v.is_fully_replicated
        if spread or not skip:
            out[k] = _crc(host_value(v))
    out["meta"] = _meta_crc(meta)
    return out


#: What orbax / tensorstore / JSON say of a file that is not what was written (anything else, say
#: a transient read error or memory, is raised as it is: the backup is not set aside for it).
_DAMAGE_SIGNS = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "Error decoding", "Unknown key", "Expecting",
                 "Unterminated", "Extra data", "Invalid", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "does not exist",
                 "No such file", "not a directory", "truncated", "checksum")


def _is_damage(e: BaseException) -> bool:
    if isinstance(e, (FileNotFoundError, KeyError, json.JSONDecodeError, UnicodeDecodeError)):
        return True
    return isinstance(e, (ValueError, OSError, TypeError)) and any(sign in str(e) for sign in _DAMAGE_SIGNS)


class TrainingCheckpointer:
    """Numbered checkpoints in `directory`; keeps the newest `max_to_keep`.

    >>> import tempfile, numpy as np, lockstep.checkpoint as ck
    >>> c = ck.TrainingCheckpointer(tempfile.mkdtemp())
    >>> c.save(3, {"w": np.arange(4.0)}, {"epoch": 1})
    >>> step = c.latest_step(); arrays, meta = c.restore(step)
    >>> step, arrays["w"].tolist(), meta["epoch"]
    (3, [0.0, 1.0, 2.0, 3.0], 1)
    >>> later = ck.TrainingCheckpointer(c.directory, async_save=True)
    >>> w = np.arange(4.0); later.save(4, {"w": w}, {"epoch": 2}); w[:] = -1   # written as it was at save
    >>> later.wait(); later.restore(later.latest_step())[0]["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """

    def __init__(self, directory: str | os.PathLike[str], max_to_keep: int = 2, async_save: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        # Deleting a step in place is not atomic (a kill midway leaves a listed, broken step), so
        # old steps are first renamed into a trash folder, which is purged separately.
        self._trash = os.path.join(self.directory, _TRASH)
        self.async_save = async_save
        # one process writes from its own thread; several workers through orbax's async checkpointing
        self._writer = BackgroundWriter("lockstep-backup") if async_save and jax.process_count() == 1 else None
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                               enable_async_checkpointing=async_save and self._writer is None,
                                               cleanup_tmp_directories=True, create=True, todelete_subdir=_TRASH)
        handlers = {"arrays": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        self.wait()
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete checkpoint's step, oldest first."""
        self.wait()
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Writes checkpoint `step` (every worker calls this together); returns when it is
        committed, or with `async_save` once its arrays are taken (a save still being written is
        finished first: `wait`)."""
        self.wait()  # the previous save committed and its deletions purged: nothing moves into the trash now
        if self.async_save:  # host arrays are the caller's to change once this returns: written as they are now
            arrays = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
        if self._writer is not None:
            self._writer.submit(self._write, step, arrays, meta)
            return
        self._write(step, arrays, meta)
        if not self.async_save:
            self.wait()

    def _write(self, step: int, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        args = self._ocp.args
        if jax.process_count() == 1:
            # Taken off the devices once, an array at a time, for the checksums and orbax alike:
            # orbax would copy every array again, queueing all of them at once, ahead of any small
            # copy the training thread makes meanwhile (a loss it logs). A background write's
            # arrays are its own (`save`): each device copy goes as soon as it is on the host.
            take = arrays.pop if self._writer is not None else arrays.get
            arrays = {k: np.asarray(take(k)) for k in list(arrays)}
        meta = {**meta, _CHECKSUMS: checksums(arrays, meta, primary_only=True)}
        self._manager.save(step, args=args.Composite(arrays=args.StandardSave(arrays), meta=args.JsonSave(meta)),
                           force=True)
        if self._writer is not None:
            self._manager.wait_until_finished()

    def wait(self, everywhere: bool = False) -> None:
        """Returns when every save made so far is committed (at once for synchronous saves); an
        error of a background write is raised here. `everywhere`: and every worker knows it (a
        barrier after the commit, which worker 0 makes: every worker must call this together)."""
        if self._writer is not None:
            self._writer.wait()
        self._manager.wait_until_finished()
        self._purge()
        if everywhere:
            self._barrier("lockstep backups committed")

    def _purge(self) -> None:
        if jax.process_index() == 0:
            shutil.rmtree(self._trash, ignore_errors=True)

    def restore(self, step: int, shardings: dict[str, Any] | None = None, default_sharding: Any = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The arrays and the JSON of checkpoint `step` (every worker calls this together).

        Each array is placed with `shardings[name]`, else `default_sharding`; with neither it
        comes back as NumPy (single process only).

        Raises:
          DamagedCheckpointError: the checkpoint's files are not what was written: they cannot
            be decoded, or what is read differs from its checksums. Other errors (a transient
            read error, memory) are raised as they are.
        """
        self.wait()
        args = self._ocp.args
        shardings = shardings or {}
        try:
            saved = self._manager.item_metadata(step)["arrays"]
            if not shardings and default_sharding is None:
                target = args.StandardRestore()
            else:
                target = args.StandardRestore({
                    k: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=shardings.get(k, default_sharding))
                    for k, m in saved.items()})
            out = self._manager.restore(step, args=args.Composite(arrays=target, meta=args.JsonRestore()))
            arrays, meta = dict(out["arrays"]), dict(out["meta"])
        except Exception as e:  # noqa: BLE001 - what orbax, tensorstore or JSON raise on a damaged file
            if not _is_damage(e):
                raise
            raise DamagedCheckpointError(step, f"{type(e).__name__}: {(str(e).strip() or '?').splitlines()[0][:300]}"
                                         ) from e
        if not shardings and default_sharding is None:
            arrays = {k: np.asarray(v) for k, v in arrays.items()}
        expected = meta.pop(_CHECKSUMS, None)
        if expected is not None:  # checkpoints written before checksums were recorded are taken as they are
            found = checksums(arrays, meta)
            wrong = [k for k in sorted(set(expected) | set(found)) if expected.get(k) != found.get(k)]
            if wrong:
                raise DamagedCheckpointError(step, f"the checksum of {wrong[0]!r} differs from the one written"
                                             + (f" (and of {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
        return arrays, meta

    def set_aside(self, step: int) -> str:
        """Moves checkpoint `step` into the ``damaged`` folder (worker 0 moves; every worker
        calls this together and waits for it); returns the new path.

        Raises:
          OSError: the checkpoint could not be moved (on worker 0, after every worker has waited).
        """
        self.wait()
        aside = os.path.join(self.directory, DAMAGED, str(step))
        n = 1
        while os.path.exists(aside):
            aside = os.path.join(self.directory, DAMAGED, f"{step}.{n}")
            n += 1
        self._barrier(f"lockstep set aside checkpoint {step}: named")  # every worker named it before the move
        try:
            if jax.process_index() == 0:
                os.makedirs(os.path.dirname(aside), exist_ok=True)
                os.replace(os.path.join(self.directory, str(step)), aside)
        finally:
            self._barrier(f"lockstep set aside checkpoint {step}: moved")
            self._manager.reload()
        return aside

    @staticmethod
    def _barrier(name: str) -> None:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(name)

    def delete_all(self) -> None:
        """Removes every checkpoint (the chief deletes; every worker waits for it)."""
        # the steps this manager saved or read, not a fresh listing: a worker listing the directory
        # after the chief's first deletion would call `delete` fewer times, and orbax's barriers in
        # `delete` would then pair different calls on different workers (a flaky failure)
        self.wait()
        for step in self._manager.all_steps():
            self._manager.delete(step)
        self._manager.wait_until_finished()
        self._purge()

    def close(self) -> None:
        """Finishes the saves in progress (an error of a background write is raised) and closes."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
            self._manager.close()


