"""tf.distribute's multi-worker example: each worker prints its task, chief flag, replicas and a reduced total."""

import lockstep as ls
s = ls.MultiWorkerMirroredStrategy()
import numpy as np
r = s.cluster_resolver
x = np.arange(10.0, dtype=np.float32)
total = sum(float(s.reduce("SUM", s.run(lambda b: b, args=(b,)), axis=0))
            for b in s.experimental_distribute_dataset(ls.data.batches(x, 4)))
print("task", r.task_id, "chief", r.is_chief, "replicas", s.num_replicas_in_sync, "total", total, flush=True)
