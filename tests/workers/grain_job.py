"""A `grain.MapDataset` trained on by several workers: argv = out_dir. Each worker logs which
samples its source read during `fit` and during `evaluate`; rank 0 saves the results."""

import json
import os
import sys


import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()

import grain  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402

out_dir = sys.argv[1]
rank = strategy.cluster_resolver.task_id

source = common.LoggingSource(203)
dataset = grain.MapDataset.source(source).map(lambda s: (s[0] * 2.0, s[1]))  # decoding/transforms run per read
t = common.trainer(strategy)
hist = t.fit(dataset, batch_size=32, epochs=2, seed=4, verbose=0)
fit_reads, source.reads = source.reads, []
ev = t.evaluate(dataset, batch_size=32)
with open(os.path.join(out_dir, f"reads{rank}.json"), "w") as f:
    json.dump({"fit": fit_reads, "evaluate": source.reads}, f)
if rank == 0:
    np.savez(os.path.join(out_dir, "final.npz"), weights=common.flat(t.get_weights()))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"history": {k: [float(v) for v in vs] for k, vs in hist.history.items()},
                   "evaluate": {k: float(v) for k, v in ev.items()}}, f)
print(f"worker {rank} finished", flush=True)
