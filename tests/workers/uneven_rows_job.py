"""Each worker fits arrays of its own length (20 + 3 * worker index)."""

import os
import numpy as np, jax.numpy as jnp, lockstep as ls
s = ls.MultiWorkerMirroredStrategy()
n = 20 + 3 * s.worker_index
m = ls.FunctionalModel(init=lambda k, x: {"w": jnp.zeros((2, 2))}, apply=lambda p, x, training=False: x @ p["w"])
ls.Trainer(m, strategy=s).fit(np.ones((n, 2), np.float32), np.zeros(n, int), batch_size=4, verbose=0)
