"""Worker 1 predicts while worker 0 fits: their programs differ."""

import numpy as np

import lockstep as ls
from common import linear_model

s = ls.MultiWorkerMirroredStrategy()
t = ls.Trainer(linear_model(), strategy=s)
x, y = np.ones((40, 2), np.float32), np.zeros(40, int)
t.evaluate(x, y, batch_size=4, verbose=0)
if s.worker_index == 1:
    t.predict(x, batch_size=4, verbose=0)  # while worker 0 calls fit
t.fit(x, y, batch_size=4, verbose=0)
