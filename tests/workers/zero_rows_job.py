"""scikit-learn's digits on 2 workers x 1 device, batch 64: each epoch's last batch has 5 rows, all
of them worker 0's, so worker 1 holds no real row at steps 29, 58, ... (the issue's report).
argv = out_dir [damage] [k=<steps_per_execution>]. Backups every 2 steps; on the first attempt the last worker SIGKILLs itself
right after step 58 and its backup, a backup step where it holds no row (with `damage`, it first flips a bit in
each of that backup's array files: the restart must set it aside and resume from step 56). The
restart reads that batch again to check it (worker 1's part of the checksum: nothing). `run` is
the job, shared with the one-process reference. With k=4 (4 steps a call) the calls of epoch 2
end at steps 33, 37, ..., 57 and 58: the kill and the backup land at the end of the last.
"""

import os
import pathlib
import signal
import sys


import lockstep as ls  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import common  # noqa: E402


class Chaos(ls.callbacks.Callback):
    def __init__(self, rank, attempt, backup, damage_dir=None):
        super().__init__()
        self.rank, self.attempt, self.backup, self.damage_dir = rank, attempt, backup, damage_dir

    def on_train_batch_begin(self, batch, logs=None):  # after step 58 and its backup, before the next step
        if self.attempt == 0 and self.model.global_step == 58:
            self.backup.wait()  # the backup of step 58, written in the background, committed on every worker
        if self.rank == 1 and self.attempt == 0 and self.model.global_step == 58:
            if self.damage_dir:
                for f in pathlib.Path(self.damage_dir, "58").glob("arrays/**/d/*"):
                    data = bytearray(f.read_bytes())
                    data[len(data) // 2] ^= 0x10
                    f.write_bytes(bytes(data))
            os.kill(os.getpid(), signal.SIGKILL)


def run(strategy, callbacks=(), steps_per_execution=1):
    x, y = load_digits(return_X_y=True)
    t = ls.Trainer(common.model(10), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                   metrics=["accuracy"], strategy=strategy, steps_per_execution=steps_per_execution)
    hist = t.fit((x / 16.0).astype(np.float32), y, batch_size=64, epochs=3, shuffle=True, seed=2, verbose=0,
                 callbacks=list(callbacks))
    return t, hist


if __name__ == "__main__":
    out_dir = sys.argv[1]
    strategy = ls.MultiWorkerMirroredStrategy()
    rank, attempt = strategy.cluster_resolver.task_id, int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
    backup = ls.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=2)
    damage = "damage" in sys.argv[2:]
    k = int(next((a.split("=")[1] for a in sys.argv[2:] if a.startswith("k=")), 1))
    t, hist = run(strategy, [backup, Chaos(rank, attempt, backup, os.path.join(out_dir, "backup") if damage else None)], k)
    if rank == 0:
        common.save_result(out_dir, t, hist, backup.restored_from)
    print(f"worker {rank} finished (attempt {attempt})", flush=True)
