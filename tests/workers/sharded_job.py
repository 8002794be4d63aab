"""Sharded models on a mesh spanning the workers (`ls.ShardedStrategy` under `lockstep launch`):
argv = out_dir, which holds cases.json (a list of cases, run one after another in these processes).

Each case: {"model", "shape" (batch x model mesh over every worker's devices, or replica x batch x model:
hybrid sharding), "stage", "n" (rows),
"mode", "backup" (a directory), "keras_defaults" (no seed, Keras' default verbosity; worker 0 writes
the initial weights every worker starts from as init<j> in case<i>.npz)}. Modes:
- "fit": Keras code as written in the scope (compile / fit with Keras' ModelCheckpoint, whole
  model and weights only / evaluate / predict / get_weights / save); worker 0 writes case<i>.npz
  (weights, predictions, the weights read back from each file written) and case<i>.json
  (history, evaluation).
- "resume": fit with `BackupAndRestore(backup)` that resumes a backup taken elsewhere; the state
  just restored (parameters and optimizer state, whole) goes to case<i>_restored.npz.
- "preempt": the same fit cut short after its first epoch's backup (as a preempted job).
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("KERAS_BACKEND", "jax")

import lockstep as ls  # noqa: E402

out_dir = sys.argv[1]
with open(os.path.join(out_dir, "cases.json")) as f:
    cases = json.load(f)
strategies = {}


def strategy_for(case):
    """One strategy a model, mesh and stage (the first joins the workers, before JAX starts)."""
    key = (case["model"], tuple(case["shape"]), case["stage"])
    if key not in strategies:
        strategies[key] = sharded.sharded_strategy(key[1], key[2], sharded.used_rules(key[0]),
                                                   max_replicated_fraction=1.0)
    return strategies[key]


import sharded_cases as sharded  # noqa: E402  (imports JAX: after the lockstep import only)

strategy_for(cases[0])  # joins the workers before anything else runs on JAX

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from lockstep.engine._cross_replica import host_value  # noqa: E402


class DumpRestored(ls.callbacks.Callback):
    """The state the run starts from (a restored backup's), whole, written by worker 0."""

    def __init__(self, path):
        super().__init__()
        self.path, self.done = path, False

    def on_epoch_begin(self, epoch, logs=None):
        if self.done:
            return
        self.done = True
        state = self.trainer.train_state
        leaves = [host_value(a) for a in jax.tree.leaves((state.params, state.opt_state))]
        if jax.process_index() == 0:
            np.savez(self.path, *leaves)


rank = jax.process_index()
for i, case in enumerate(cases):
    strategy = strategy_for(case)
    factory = sharded.ALL_MODELS[case["model"]]
    x, y = sharded.case_data(case["model"], n=case.get("n", 37))
    defaults = case.get("keras_defaults", False)
    with strategy.scope():
        if not defaults:
            keras.utils.set_random_seed(1)
        model = factory()
        model.compile(**sharded.COMPILE)
    if case["mode"] == "fit":
        initial = model.get_weights() if defaults else []  # worker 0's, which every worker takes
        verbose = {"verbose": 0} if not defaults else {}
        checkpoint = os.path.join(out_dir, f"case{i}_checkpoint.keras")
        weights_file = os.path.join(out_dir, f"case{i}.weights.h5")
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, **verbose, callbacks=[
            keras.callbacks.ModelCheckpoint(checkpoint), keras.callbacks.ModelCheckpoint(weights_file,
                                                                                         save_weights_only=True)])
        evaluation = model.evaluate(x, y, batch_size=8, **verbose)
        predictions = model.predict(x, batch_size=8, **verbose)
        weights = model.get_weights()
        path = os.path.join(out_dir, f"case{i}.keras")
        model.save(path)
        if rank == 0:
            saved = keras.saving.load_model(path).get_weights()
            checkpointed = keras.saving.load_model(checkpoint).get_weights()
            fresh = factory()
            fresh.load_weights(weights_file)
            np.savez(os.path.join(out_dir, f"case{i}.npz"), predictions=predictions,
                     **{f"w{j}": w for j, w in enumerate(weights)}, **{f"s{j}": w for j, w in enumerate(saved)},
                     **{f"c{j}": w for j, w in enumerate(checkpointed)},
                     **{f"h{j}": w for j, w in enumerate(fresh.get_weights())},
                     **{f"init{j}": w for j, w in enumerate(initial)})
            with open(os.path.join(out_dir, f"case{i}.json"), "w") as f:
                json.dump({"history": history.history, "evaluate": evaluation}, f)
    else:
        callbacks = [ls.callbacks.BackupAndRestore(case["backup"])]
        if case["mode"] == "resume":
            callbacks.append(DumpRestored(os.path.join(out_dir, f"case{i}_restored.npz")))
        else:
            callbacks.append(sharded.StopAfterFirstEpoch())
        trainer = ls.Trainer(model)
        try:
            history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        except sharded.Preempted:
            history = None
        weights = trainer.get_weights()
        if rank == 0:
            np.savez(os.path.join(out_dir, f"case{i}.npz"), **{f"w{j}": w for j, w in enumerate(weights)})
            with open(os.path.join(out_dir, f"case{i}.json"), "w") as f:
                json.dump({"history": None if history is None else history.history}, f)
    print(f"case {i} done: {case}", flush=True)
