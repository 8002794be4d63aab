"""Worker 1 kills (KILL) or freezes (STOP) itself after 20 all-reduce steps: `fault_job.py KILL|STOP`."""

import os, signal, sys, time
import lockstep as ls
s = ls.MultiWorkerMirroredStrategy()
import numpy as np, jax.numpy as jnp
w = jnp.zeros(())
batch = next(iter(s.experimental_distribute_dataset([np.ones(8, np.float32)])))
for i in range(100000):
    w = s.run(lambda w, b: w + ls.get_replica_context().all_reduce("SUM", jnp.sum(b)), args=(w, batch))
    if i == 20 and s.cluster_resolver.task_id == 1:
        print("pid", os.getpid(), flush=True)
        os.kill(os.getpid(), getattr(signal, "SIG" + sys.argv[1]))
    time.sleep(0.01)
