"""Data, model and settings shared by the multi-worker job and the single-process references."""

import socket

import jax
import jax.numpy as jnp
import numpy as np

import lockstep as ls

N = 1003


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)
    return x, y


def model(classes=3):
    def init(rng, x):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (x.shape[-1], 16)) * 0.3, "b1": jnp.zeros(16),
                "w2": jax.random.normal(k2, (16, classes)) * 0.3, "b2": jnp.zeros(classes)}
    return ls.FunctionalModel(init, lambda p, x, training=False: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])


def linear_model():
    """``x @ w``, `w` a (2, 2) matrix of zeros: the small model of the jobs that end in an error."""
    return ls.FunctionalModel(init=lambda k, x: {"w": jnp.zeros((2, 2))}, apply=lambda p, x, training=False: x @ p["w"])


def keras_mlp(features=8, classes=3, seed=0, batch_norm=False, dropout=0.0, softmax=True):
    """A Keras MLP built from `seed` (a softmax output, or logits); optionally with BatchNorm and
    Dropout."""
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((features,)), keras.layers.Dense(16, activation="relu")]
    layers += [keras.layers.BatchNormalization()] if batch_norm else []
    layers += [keras.layers.Dropout(dropout)] if dropout else []
    return keras.Sequential([*layers, keras.layers.Dense(classes, activation="softmax" if softmax else None)])


def trainer(strategy):
    return ls.Trainer(model(), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                      metrics=["accuracy", ls.metrics.F1Score(average="macro")], strategy=strategy)


def flat(tree):
    """Every leaf of `tree`, raveled into one vector."""
    return np.concatenate([np.ravel(v) for v in jax.tree.leaves(tree)])


def save_result(out_dir, t, hist, restored_from):
    """A job's final weights and history, as `launching.resume_result` reads them (worker 0 writes them)."""
    import json
    import os

    np.savez(os.path.join(out_dir, "final.npz"), weights=flat(t.get_weights()))
    with open(os.path.join(out_dir, "history.json"), "w") as f:
        json.dump({"epoch": hist.epoch, "history": {k: [float(v) for v in vs] for k, vs in hist.history.items()},
                   "restored_from": restored_from}, f)


class ChiefReadsRunning(ls.callbacks.Callback):
    """Worker 0 alone reads the running loss and metrics as each batch begins (a user's ``if
    is_chief()``), where no callback reads the batches' logs: `running`, each read's values."""

    def __init__(self):
        super().__init__()
        self.running = []

    def on_train_batch_begin(self, batch, logs=None):
        if ls.callbacks.is_chief():
            self.running.append([float(v) for v in self.trainer.metrics_result().values()])


def basic_run(t, x, y):
    """The job both sides run: evaluate, predict, then fit from the same start."""
    ev = t.evaluate(x, y, batch_size=64)
    pred = t.predict(x, batch_size=64)
    init = t.get_weights()
    reads = ChiefReadsRunning()
    hist = t.fit(x, y, batch_size=64, epochs=2, seed=1, verbose=0, callbacks=[reads])
    return {"ev": ev, "pred": pred, "init": flat(init), "fit": flat(t.get_weights()), "loss": hist.history["loss"],
            "running": np.array([r for r in reads.running if r] or [[np.nan]])}


def uneven_batches(worker, num_workers):
    """Worker 0 has 5 batches of 40, the others 3 batches of 30 (distinct samples)."""
    x, y = data(400, seed=7)
    sizes = [5 * 40] + [3 * 30] * (num_workers - 1)
    lo = sum(sizes[:worker])
    size = 40 if worker == 0 else 30
    xs, ys = x[lo:lo + sizes[worker]], y[lo:lo + sizes[worker]]
    return [(xs[i:i + size], ys[i:i + size]) for i in range(0, len(xs), size)]


def validation_parts(num_workers):
    """Worker 0's validation data follow the training labels; the last worker's are flipped, so its
    local val_loss alone rises as the model learns, while the global one falls for a while."""
    x, y = data(300, seed=11)
    parts = np.array_split(np.arange(300), num_workers)
    out = []
    for w, idx in enumerate(parts):
        yy = y[idx] if w < num_workers - 1 else (2 - y[idx])
        out.append((x[idx], yy))
    return out


ES = {"monitor": "val_loss", "patience": 1, "min_delta": 0.0}


class LoggingSource:
    """A random-access source of `data(n)`'s samples that logs every index read, in order (the
    worker jobs' instrumented Grain source)."""

    def __init__(self, n):
        self.x, self.y = data(n)
        self.reads = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.x[i], self.y[i]
