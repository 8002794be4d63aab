"""The multi-worker job: evaluate, predict, fit, uneven pipelines and early stopping; each worker
saves what it saw to OUT_DIR/rank<k>.npz."""

import os
import sys


import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()

import numpy as np  # noqa: E402

import common  # noqa: E402

out_dir = sys.argv[1]
rank, workers = strategy.cluster_resolver.task_id, strategy.num_workers
x, y = common.data()
t = common.trainer(strategy)
run = common.basic_run(t, x, y)
ev = run["ev"]

uneven = t.evaluate(strategy.distribute_datasets_from_function(lambda ctx: common.uneven_batches(
    ctx.input_pipeline_id, ctx.num_input_pipelines)))

es_t = common.trainer(strategy)
vx, vy = common.validation_parts(workers)[rank]
es = ls.callbacks.EarlyStopping(**common.ES)
# every worker takes each epoch's weights (device copies), worker 0 writes them in the background
checkpoint = ls.callbacks.ModelCheckpoint(os.path.join(out_dir, "es-{epoch}.npz"), save_weights_only=True)
es_hist = es_t.fit(x, y, batch_size=64, epochs=12, seed=2, verbose=0, callbacks=[es, checkpoint],
                   validation_data=strategy.distribute_datasets_from_function(
                       lambda ctx: [(vx[i:i + 32], vy[i:i + 32]) for i in range(0, len(vx), 32)]))
last = ls.checkpoint.load_tree(os.path.join(out_dir, f"es-{len(es_hist.epoch)}.npz"), es_t.get_weights())[0] \
    if rank == 0 else es_t.get_weights()  # (worker 0 wrote it)

np.savez(os.path.join(out_dir, f"rank{rank}.npz"),
         ev=np.array([ev["loss"], ev["accuracy"], ev["f1_score"]]), pred=run["pred"], init=run["init"],
         fit=run["fit"], loss=np.array(run["loss"]), running=run["running"],
         uneven=np.array([uneven["loss"], uneven["accuracy"], uneven["f1_score"]]),
         es_epochs=np.array(es_hist.epoch), es_val=np.array(es_hist.history["val_loss"]),
         es_weights=common.flat(es_t.get_weights()), es_written=common.flat(last),
         replicas=strategy.num_replicas_in_sync)
print(f"worker {rank} of {workers} done")
