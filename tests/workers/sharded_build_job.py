"""Building a Keras model in a `ShardedStrategy` scope whose mesh spans the workers, unseeded (each
worker draws its own initialiser seeds): argv = out_dir. Each worker records whether a split
variable's value was ever given whole to Keras' `distribute_tensor` (it may not: each shard is
made where it lies); worker 0 writes the weights (whole) and the weights its own initialisers
make outside any scope (its Python random state as before the build) to built.npz."""

import json
import os
import random
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import lockstep as ls  # noqa: E402

out_dir = sys.argv[1]
strategy = ls.ShardedStrategy(mesh=ls.DeviceMesh((4, 1), ("batch", "model")), zero_stage=3, min_shard_size=1,
                              max_replicated_fraction=1.0)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras.src.backend.jax import distribution_lib  # noqa: E402


def model():
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, name="a"),
                             keras.layers.Dense(8, kernel_initializer="orthogonal", name="b"),
                             keras.layers.Dense(3, bias_initializer="ones", name="c")])


whole = []
original = distribution_lib.distribute_tensor


def spy(tensor, layout):
    sharding = getattr(layout, "backend_layout", layout)
    if not sharding.is_fully_replicated and np.ndim(tensor) > 0:
        whole.append(str(getattr(tensor, "shape", "?")))
    return original(tensor, layout)


distribution_lib.distribute_tensor = spy
random.seed(1000 + jax.process_index())  # every worker its own initialiser seeds, as an unseeded script
before = random.getstate()
with strategy.scope():
    built = model()
split = sum(not v.value.sharding.is_fully_replicated for v in built.weights)
values = [np.asarray(w) for w in ls.Trainer(built).get_weights()]  # gathered whole (a collective)
if jax.process_index() == 0:
    random.setstate(before)
    own = [np.asarray(w) for w in model().get_weights()]  # worker 0's initialisers, outside any scope
    np.savez(os.path.join(out_dir, "built.npz"), **{f"w{i}": w for i, w in enumerate(values)},
             **{f"own{i}": w for i, w in enumerate(own)})
print("RESULT " + json.dumps({"whole": whole, "split": split}), flush=True)
