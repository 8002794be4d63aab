"""Each worker fits arrays of its own length (20 + 3 * worker index)."""

import numpy as np

import lockstep as ls
from common import linear_model

s = ls.MultiWorkerMirroredStrategy()
n = 20 + 3 * s.worker_index
ls.Trainer(linear_model(), strategy=s).fit(np.ones((n, 2), np.float32), np.zeros(n, int), batch_size=4, verbose=0)
