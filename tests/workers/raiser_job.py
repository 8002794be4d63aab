"""Worker 1 raises after one fit while worker 0 goes on training."""

import numpy as np, jax.numpy as jnp, lockstep as ls
s = ls.MultiWorkerMirroredStrategy()
m = ls.FunctionalModel(init=lambda k, x: {"w": jnp.zeros((2, 2))}, apply=lambda p, x, training=False: x @ p["w"])
t = ls.Trainer(m, strategy=s)
x, y = np.ones((400, 2), np.float32), np.zeros(400, int)
t.fit(x, y, batch_size=4, verbose=0)
if s.worker_index == 1:
    raise RuntimeError("boom in rank 1")
t.fit(x, y, batch_size=4, epochs=100, verbose=0)
