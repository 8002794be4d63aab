"""The models, data and strategies of the sharded-model tests (`tests/test_sharded.py`), shared
with the job that runs them on a mesh spanning worker processes (`tests/workers/sharded_job.py`)."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers as L  # noqa: E402

import keras_reference  # noqa: E402
import lockstep as ls  # noqa: E402

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
RULES = {".*dense.*/kernel": (None, "model"), ".*conv.*/kernel": (None, None, None, "model"),
         ".*norm/(gamma|beta|moving_mean|moving_variance)": ("model",),
         ".*lstm.*/kernel": (None, "model"), ".*embedding.*/embeddings": (None, "model"),
         ".*attention/(query|key|value)/kernel": (None, None, "model"),  # Megatron: heads' features split
         ".*attention_output/kernel": (None, "model", None)}


def mlp():
    return keras.Sequential([keras.Input((12,)), L.Dense(32, activation="relu", name="dense_a"),
                             L.Dropout(0.0), L.Dense(4, name="head")])


def cnn():
    return keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(8, 3, use_bias=False, name="conv"), L.BatchNormalization(),
                             L.ReLU(), L.Flatten(), L.Dense(4, name="head")])


def lstm():
    return keras.Sequential([keras.Input((5, 3)), L.Masking(0.0), L.LSTM(16, name="lstm"), L.Dense(4, name="head")])


def transformer():
    inp = keras.Input((7,), dtype="int32")
    h = L.Embedding(32, 16, name="embedding")(inp)
    a = L.MultiHeadAttention(num_heads=2, key_dim=8, name="attention")(h, h)
    h = L.LayerNormalization(name="norm")(h + a)
    h = L.Dense(32, activation="relu", name="dense_ffn")(h)
    h = L.GlobalAveragePooling1D()(h)
    return keras.Model(inp, L.Dense(4, name="head")(h))


def odd():
    """An MLP whose widths (30, 7) the meshes' axes mostly do not divide: uneven splits, stored padded."""
    return keras.Sequential([keras.Input((12,)), L.Dense(30, activation="relu", name="dense_a"),
                             L.Dense(7, activation="relu", name="dense_b"), L.Dense(4, name="head")])


def odd_cnn():
    """A CNN + BatchNorm of 6 channels (split over 4 or 8 model devices: padded, batch-norm
    statistics included)."""
    return keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(6, 3, use_bias=False, name="conv"),
                             L.BatchNormalization(name="norm"), L.ReLU(), L.Flatten(), L.Dense(4, name="head")])


def functional_mlp(width, classes):
    """A plain-JAX MLP (`ls.FunctionalModel`): dense_1 of `width` units, tanh, dense_2 of `classes`."""
    import jax
    import jax.numpy as jnp

    def init(rng, x):
        k1, k2 = jax.random.split(rng)
        return {"dense_1": {"w": jax.random.normal(k1, (x.shape[1], width)) * 0.1, "b": jnp.zeros(width)},
                "dense_2": {"w": jax.random.normal(k2, (width, classes)) * 0.1, "b": jnp.zeros(classes)}}

    def apply(p, x, training=False):
        return jnp.tanh(x @ p["dense_1"]["w"] + p["dense_1"]["b"]) @ p["dense_2"]["w"] + p["dense_2"]["b"]
    return ls.FunctionalModel(init, apply)


def case_data(name, n=37, seed=0):
    name = {"odd": "mlp", "odd_cnn": "cnn"}.get(name, name)
    rng = np.random.RandomState(seed)
    x = {"mlp": lambda: rng.randn(n, 12), "cnn": lambda: rng.randn(n, 6, 6, 2),
         "lstm": lambda: rng.randn(n, 5, 3) * (rng.rand(n, 5, 1) > 0.3),
         "transformer": lambda: rng.randint(0, 32, (n, 7))}[name]()
    x = x.astype("int32" if name == "transformer" else "float32")
    return x, rng.randint(0, 4, n)


MODELS = {"mlp": mlp, "cnn": cnn, "lstm": lstm, "transformer": transformer}
ODD_MODELS = {"odd": odd, "odd_cnn": odd_cnn}
ALL_MODELS = {**MODELS, **ODD_MODELS}
COMPILE = dict(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               metrics=["accuracy"])


def sharded_strategy(shape, stage, rules=RULES, **kw):
    """A (batch, model) mesh, or a (replica, batch, model) one: hybrid sharding, whole copies
    along "replica" and ZeRO along "batch"."""
    if len(shape) == 3:
        kw.setdefault("replica_dim_name", "replica")
    mesh = ls.DeviceMesh(shape, ("replica", "batch", "model")[3 - len(shape):])
    layout = ls.LayoutMap(mesh)
    for key, axes in rules.items():
        layout[key] = axes
    kw.setdefault("min_shard_size", 128)
    kw.setdefault("max_replicated_fraction", 0.3)
    return ls.ShardedStrategy(mesh=mesh, layout_map=layout, batch_dim_name="batch", zero_stage=stage, **kw)


def keras_fit(factory, x, y, epochs=2):
    """Keras' own one-device fit of `factory()` as the sharded tests train it: (weights, history)."""
    return keras_reference.keras_fit(factory, x, y, seed=1, compile=COMPILE, batch_size=8, epochs=epochs)


def sharded_fit(factory, strategy, x, y, epochs=2):
    """Lockstep's `Trainer.fit` of `factory()` built and compiled in `strategy`'s scope; (trainer, (weights, history))."""
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = factory()
        model.compile(**COMPILE)
    trainer = ls.Trainer(model)
    history = trainer.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return trainer, (trainer.get_weights(), history.history)


def backed_up_fit(strategy, backup_dir, x, y, epochs=2, cut_short=False):
    """`mlp` built in `strategy`'s scope and fitted by lockstep's `Trainer` with a `BackupAndRestore`
    in `backup_dir`, cut short after its first epoch (`Preempted`) when `cut_short`; (trainer, backup)."""
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = mlp()
        model.compile(**COMPILE)
    trainer = ls.Trainer(model)
    backup = ls.callbacks.BackupAndRestore(str(backup_dir))
    callbacks = [backup, StopAfterFirstEpoch()] if cut_short else [backup]
    trainer.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return trainer, backup


def used_rules(model_name):
    keys = {"mlp": [".*dense.*/kernel"], "cnn": [".*conv.*/kernel"], "lstm": [".*lstm.*/kernel"],
            "transformer": [".*dense.*/kernel", ".*embedding.*/embeddings", ".*attention/(query|key|value)/kernel",
                            ".*attention_output/kernel"],
            "odd": [".*dense.*/kernel"], "odd_cnn": [".*conv.*/kernel", ".*norm/(gamma|beta|moving_mean|moving_variance)"],
            }[model_name]
    return {k: RULES[k] for k in keys}


def device_bytes(tree):
    """Bytes of `tree`'s arrays on each device, from their shards."""
    out = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


class Preempted(Exception):
    """What `StopAfterFirstEpoch` raises: a run cut short, as a preempted job dies."""


class StopAfterFirstEpoch(ls.callbacks.Callback):
    """Stops a run after its first epoch's backup (backups run last among the epoch-end callbacks,
    so the stop comes as the second epoch begins)."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise Preempted
