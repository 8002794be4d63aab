"""Worker 1 raises after one fit while worker 0 goes on training."""

import numpy as np

import lockstep as ls
from common import linear_model

s = ls.MultiWorkerMirroredStrategy()
t = ls.Trainer(linear_model(), strategy=s)
x, y = np.ones((400, 2), np.float32), np.zeros(400, int)
t.fit(x, y, batch_size=4, verbose=0)
if s.worker_index == 1:
    raise RuntimeError("boom in rank 1")
t.fit(x, y, batch_size=4, epochs=100, verbose=0)
