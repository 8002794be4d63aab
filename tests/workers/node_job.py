"""The multi-node job: zero_rows_job's fit (scikit-learn's digits, batch 64, 3 epochs), backups
every 4 steps. argv = out_dir [slow]. With `slow`, each step waits 0.2 s and worker 0 prints
"step k" (a test takes a node's link down meanwhile). Worker 0 writes the final weights and
history (`common.save_result`); `run` is the job, shared with the one-process reference.
"""

import os
import sys
import time


import lockstep as ls  # noqa: E402

import common  # noqa: E402
from zero_rows_job import run  # noqa: E402, F401  (the same fit; the references import it from here)


class Slow(ls.callbacks.Callback):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def on_train_batch_end(self, batch, logs=None):
        if self.rank == 0:
            print(f"step {self.model.global_step}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    out_dir = sys.argv[1]
    strategy = ls.MultiWorkerMirroredStrategy()
    rank, attempt = strategy.cluster_resolver.task_id, int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
    backup = ls.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=4)
    t, hist = run(strategy, [backup, *([Slow(rank)] if "slow" in sys.argv[2:] else [])])
    if rank == 0:
        common.save_result(out_dir, t, hist, backup.restored_from)
    print(f"worker {rank} of {strategy.num_workers} ({strategy.num_replicas_in_sync} replicas) finished "
          f"(attempt {attempt})", flush=True)
