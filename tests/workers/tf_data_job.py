"""A tf.data dataset of global batches on 2 workers: argv = out_dir, mode ("seeded" / "unseeded"
shuffle). Each worker logs which rows of each batch it converted during fit; rank 0 saves results."""

import json
import os
import sys


import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import common  # noqa: E402

out_dir, mode = sys.argv[1], sys.argv[2]
rank = jax.process_index()
N, B = 203, 32
x, y = common.data(N)
ds = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 2.0, b))
ds = ds.shuffle(N, seed=3 if mode == "seeded" else None, reshuffle_each_iteration=False).batch(B)
# the same shuffle of the indices (its order depends on the seeds only): the order the test replays
order = tf.data.Dataset.range(N).shuffle(N, seed=3, reshuffle_each_iteration=False)
order = [int(i) for i in order.as_numpy_iterator()]

rows = []
host_pass = ls.data.TFDatasetBatches.host_pass


def logged(self, epoch, start=0, state=None):  # record which rows of each batch this worker converts
    for batch in host_pass(self, epoch, start, state):
        read = batch.read

        def logging_read(a, b, read=read):
            rows.append([a, b])
            return read(a, b)
        batch.read = logging_read
        yield batch


ls.data.TFDatasetBatches.host_pass = logged
t = common.trainer(strategy)
hist = t.fit(ds, epochs=2, verbose=0)
fit_rows = list(rows)
ev = t.evaluate(ds)
with open(os.path.join(out_dir, f"rows{rank}.json"), "w") as f:
    json.dump(fit_rows, f)
if rank == 0:
    np.savez(os.path.join(out_dir, "final.npz"), weights=common.flat(t.get_weights()))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"order": order, "history": {k: [float(v) for v in vs] for k, vs in hist.history.items()},
                   "evaluate": {k: float(v) for k, v in ev.items()}}, f)
print(f"worker {rank} finished", flush=True)
