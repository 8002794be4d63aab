"""A training job that can be killed, preempted and restarted: argv = out_dir, mode.

mode "plain": uninterrupted; "kill": on the first attempt the last worker SIGKILLs itself at
global step 42 (mid-epoch); "term": every step is slowed down so a test can send SIGTERM;
"es": as "kill" (at step 42), with EarlyStopping on a validation set.
"""

import os
import signal
import sys
import time


import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()

import numpy as np  # noqa: E402

import common  # noqa: E402

out_dir, mode = sys.argv[1], sys.argv[2]
rank, workers = strategy.cluster_resolver.task_id, strategy.num_workers
attempt = int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
print(f"pid {os.getpid()} attempt {attempt}", flush=True)


class Chaos(ls.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        if mode in ("kill", "es") and attempt == 0 and self.count == 42:
            backup.wait()  # the backup of step 40, written in the background, committed: the newest
            if rank == workers - 1:
                os.kill(os.getpid(), signal.SIGKILL)
        if mode == "term":
            print(f"step {self.count}", flush=True)
            time.sleep(0.15)


x, y = common.data()
t = common.trainer(strategy)
backup = ls.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=5)
callbacks = [backup, Chaos()]
kwargs = {}
epochs = 4
if mode == "es":
    parts = common.validation_parts(2)
    kwargs["validation_data"] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    callbacks.append(ls.callbacks.EarlyStopping(**common.ES, restore_best_weights=True))
    epochs = 12
hist = t.fit(x, y, batch_size=64, epochs=epochs, seed=3, verbose=0, callbacks=callbacks, **kwargs)
if rank == 0:
    common.save_result(out_dir, t, hist, callbacks[0].restored_from)
print(f"worker {rank} finished (attempt {attempt})", flush=True)
