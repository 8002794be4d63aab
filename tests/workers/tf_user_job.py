"""A TF user's multi-worker Keras job as written: KERAS_BACKEND unset, no seed, Keras' default
`verbose`; then the same model fit on `experimental_distribute_dataset(tf.data)` and on
`distribute_datasets_from_function` with TF's per-replica batches; Keras' default shuffle, on
all rows and on batches with fewer rows than replicas; a model with dropout. Each worker prints its result."""
import json
import os
import sys

os.environ.pop("KERAS_BACKEND", None)  # as a TF user's shell has it: lockstep, imported first, selects JAX
import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()
import keras  # noqa: E402  (after lockstep, as the tutorials import: lockstep selects the JAX backend)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

N, B = int(sys.argv[1]), 16
rng = np.random.default_rng(0)  # the data only: the model's initial values are left unseeded
x = rng.normal(size=(N, 8)).astype("float32")
y = ((x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32"))


def build():
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


model = build()
init = [w.tolist() for w in model.get_weights()]
history = model.fit(x, y, batch_size=B, epochs=2, shuffle=False)  # verbose: Keras' default, 1
result = {"backend": keras.backend.backend(), "init": init, "history": history.history,
          "model_history": model.history.history, "weights": [w.tolist() for w in model.get_weights()],
          "evaluate": model.evaluate(x, y, batch_size=B)}

# the same start, fit on TF's two distributed-dataset forms (global batches; per-replica batches)
ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(B))
for name, data in [("distributed", ds), ("from_function", strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        .batch(ctx.get_per_replica_batch_size(B))))]:
    other = build()
    other.set_weights([np.asarray(w) for w in init])
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(sys.argv[2], f"{name}.keras"))  # every worker, as in TF
    h = other.fit(data, epochs=2, verbose=2, callbacks=[checkpoint])
    result[name] = {"history": h.history, "weights": [w.tolist() for w in other.get_weights()]}
# TF's custom loop: a Keras metric made in the scope, updated inside `strategy.run`
with strategy.scope():
    accuracy = keras.metrics.SparseCategoricalAccuracy()
predictions = model.predict(x, batch_size=B, verbose=0)


def update(batch):
    accuracy.update_state(batch[0], batch[1])


for batch in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((y, predictions)).batch(B)):
    strategy.run(update, args=(batch,))
result["accuracy_in_run"] = float(accuracy.result())
result["predictions"] = predictions.tolist()
# Keras' default shuffle, each worker seeded apart (`set_random_seed(rank)`): the initial values and
# every epoch's order are worker 0's (drawn from its NumPy global state, as Keras' fit draws them)
keras.utils.set_random_seed(strategy.worker_index)
shuffled = build()
h = shuffled.fit(x, y, batch_size=B, epochs=2)  # Keras' defaults: shuffle=True, verbose=1
result["shuffled"] = {"history": h.history, "weights": [w.tolist() for w in shuffled.get_weights()],
                      "after": float(np.random.uniform()), "rank": strategy.worker_index}
# 3 rows in batches of 2, shuffled from worker 0's NumPy state as Keras' fit shuffles: each epoch's
# last batch has fewer rows than replicas (worker 1's holds none), and which row it is follows the order
keras.utils.set_random_seed(strategy.worker_index)
few_rows = build()
h = few_rows.fit(x[:3], y[:3], batch_size=2, epochs=3)
result["few_rows"] = {"history": h.history, "weights": [w.tolist() for w in few_rows.get_weights()]}
# a model with dropout, each worker seeded apart (its weights and seed state are worker 0's), at Keras'
# default verbose: each worker's replica draws its rows of the global batch's masks
keras.utils.set_random_seed(100 + strategy.worker_index)
with strategy.scope():
    dropped = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dropout(0.5), keras.layers.Dense(3, activation="softmax")])
    dropped.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
result["dropout_init"] = {"weights": [w.tolist() for w in dropped.get_weights()],
                          "seed_state": [np.asarray(v.value).tolist() for v in dropped.non_trainable_variables
                                         if "seed_generator" in v.path]}
dropped.fit(x, y, batch_size=B, epochs=2, shuffle=False)
result["dropout"] = [w.tolist() for w in dropped.get_weights()]
print("RESULT", json.dumps(result), flush=True)
