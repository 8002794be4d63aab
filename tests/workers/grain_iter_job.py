"""A Grain `IterDataset` per worker (sharded by worker, as Grain does): argv = out_dir, mode.

mode "train": each worker logs the samples its source read in `fit`, in `evaluate`, and in a
run stopped at step 5 (backup at 4) and resumed in the same processes, whose iterators are set
from the backup's per-worker states; rank 0 saves weights and logs. mode "unsharded": every
worker reads the whole dataset, which fit refuses."""

import json
import os
import sys


import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402

out_dir, mode = sys.argv[1], sys.argv[2]
rank, workers = jax.process_index(), jax.process_count()
N, LOCAL_BATCH = 203, 16


source = common.LoggingSource(N)


def dataset(sharded=True):
    ds = grain.MapDataset.source(source)
    if sharded:
        ds = ds[rank::workers]  # this worker's samples only
    serial = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return ds.map(lambda s: (s[0] * 2.0, s[1])).to_iter_dataset(serial).batch(LOCAL_BATCH)


if mode == "unsharded":
    common.trainer(strategy).fit(dataset(sharded=False), epochs=1, verbose=0)
    raise SystemExit("fit accepted unsharded per-worker pipelines")


class Stop(Exception):
    pass


class StopAt(ls.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == 5:
            raise Stop


t = common.trainer(strategy)
hist = t.fit(dataset(), epochs=2, verbose=0)
reads = {"fit": source.reads}
source.reads = []
ev = t.evaluate(dataset())
reads["evaluate"], source.reads = source.reads, []
backup = os.path.join(out_dir, "backup")
try:
    common.trainer(strategy).fit(dataset(), epochs=2, verbose=0,
                                 callbacks=[ls.callbacks.BackupAndRestore(backup, save_freq=4), StopAt()])
except Stop:
    pass
reads["stopped"], source.reads = source.reads, []
resumed = common.trainer(strategy)
resumed_hist = resumed.fit(dataset(), epochs=2, verbose=0, callbacks=[ls.callbacks.BackupAndRestore(backup)])
reads["resumed"] = source.reads
with open(os.path.join(out_dir, f"reads{rank}.json"), "w") as f:
    json.dump(reads, f)
if rank == 0:
    np.savez(os.path.join(out_dir, "final.npz"), weights=common.flat(t.get_weights()),
             resumed=common.flat(resumed.get_weights()))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"history": {k: [float(v) for v in vs] for k, vs in hist.history.items()},
                   "resumed": {k: [float(v) for v in vs] for k, vs in resumed_hist.history.items()},
                   "evaluate": {k: float(v) for k, v in ev.items()}}, f)
print(f"worker {rank} finished", flush=True)
