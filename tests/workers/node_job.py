"""The multi-node job: scikit-learn's digits, batch 64, 3 epochs, backups every 4 steps.
argv = out_dir [slow]. With `slow`, each step waits 0.2 s and worker 0 prints "step k" (a test
takes a node's link down meanwhile). Worker 0 writes the final weights and history (as
`launching.resume_result` reads them); `run` is the job, shared with the one-process reference.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import lockstep as ls  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import common  # noqa: E402


class Slow(ls.callbacks.Callback):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def on_train_batch_end(self, batch, logs=None):
        if self.rank == 0:
            print(f"step {self.model.global_step}", flush=True)
        time.sleep(0.2)


def run(strategy, callbacks=()):
    x, y = load_digits(return_X_y=True)
    t = ls.Trainer(common.model(10), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                   metrics=["accuracy"], strategy=strategy)
    hist = t.fit((x / 16.0).astype(np.float32), y, batch_size=64, epochs=3, shuffle=True, seed=2, verbose=0,
                 callbacks=list(callbacks))
    return t, hist


if __name__ == "__main__":
    out_dir = sys.argv[1]
    strategy = ls.MultiWorkerMirroredStrategy()
    rank, attempt = strategy.cluster_resolver.task_id, int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
    backup = ls.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=4)
    t, hist = run(strategy, [backup, *([Slow(rank)] if "slow" in sys.argv[2:] else [])])
    if rank == 0:
        np.savez(os.path.join(out_dir, "final.npz"), weights=common.flat(t.get_weights()))
        with open(os.path.join(out_dir, "history.json"), "w") as f:
            json.dump({"epoch": hist.epoch, "history": {k: [float(v) for v in vs] for k, vs in hist.history.items()},
                       "restored_from": backup.restored_from}, f)
    print(f"worker {rank} of {strategy.num_workers} ({strategy.num_replicas_in_sync} replicas) finished "
          f"(attempt {attempt})", flush=True)
