"""Worker 1 predicts while worker 0 fits: their programs differ."""

import numpy as np, jax.numpy as jnp, lockstep as ls
s = ls.MultiWorkerMirroredStrategy()
m = ls.FunctionalModel(init=lambda k, x: {"w": jnp.zeros((2, 2))}, apply=lambda p, x, training=False: x @ p["w"])
t = ls.Trainer(m, strategy=s)
x, y = np.ones((40, 2), np.float32), np.zeros(40, int)
t.evaluate(x, y, batch_size=4, verbose=0)
if s.worker_index == 1:
    t.predict(x, batch_size=4, verbose=0)  # while worker 0 calls fit
t.fit(x, y, batch_size=4, verbose=0)
