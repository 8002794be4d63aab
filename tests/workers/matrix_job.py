"""The exactness matrix's examples on several workers: argv = out_dir, which holds runs.json (the
drawn examples). Each is interrupted at its drawn step and resumed in these processes; worker 0
writes the final weights and history to out_dir/run<i>.npz / .json."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import test_exactness_matrix as matrix  # noqa: E402

out_dir = sys.argv[1]
with open(os.path.join(out_dir, "runs.json")) as f:
    runs = json.load(f)
for i, run in enumerate(runs):
    t, hist, restored_from = matrix.interrupted_and_resumed(strategy, run, os.path.join(out_dir, f"backup{i}"))
    weights = jax.tree.leaves(t.get_weights())
    if strategy.cluster_resolver.task_id == 0:
        np.savez(os.path.join(out_dir, f"run{i}.npz"), **{f"w{j}": np.asarray(w) for j, w in enumerate(weights)})
        with open(os.path.join(out_dir, f"run{i}.json"), "w") as f:
            json.dump({"history": {k: [float(v) for v in vs] for k, vs in hist.items()},
                       "restored_from": restored_from}, f)
    print(f"run {i} done: {run}", flush=True)
