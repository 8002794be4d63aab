"""Worker 1's script ends after 3 steps; worker 0 goes on for 100."""

import numpy as np, lockstep as ls
s = ls.MultiWorkerMirroredStrategy()
b = next(iter(s.experimental_distribute_dataset([np.ones(8, np.float32)])))
for i in range(100 if s.worker_index == 0 else 3):  # worker 1 runs fewer steps
    float(s.experimental_local_results(s.run(lambda b: ls.get_replica_context().all_reduce("SUM", b.sum()),
                                             args=(b,)))[0])
