"""Trains for a long time without BackupAndRestore, printing its pid and each epoch: the test
sends SIGTERM or SIGINT to it (or to the launcher), and the job must end, not train on."""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
import lockstep as ls  # noqa: E402

strategy = ls.MultiWorkerMirroredStrategy()
import keras  # noqa: E402
import numpy as np  # noqa: E402


class Says(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print("epoch", epoch, flush=True)


print("pid", os.getpid(), flush=True)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(x, y, batch_size=8, epochs=100000, verbose=0, callbacks=[Says()])
