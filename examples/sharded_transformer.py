"""A Keras transformer language model sharded over 8 devices, equal to one device.

A small character-level transformer (token and position embeddings, causal self-attention, a
feed-forward block) learns to continue the Zen of Python (the text Python itself ships, in the
`this` module). It trains on 8 simulated CPU devices laid out as a 2 x 4 mesh: rows split along
``"batch"`` with ZeRO stage 3 (parameters, gradients and Adam's state split along it too), and
the attention and feed-forward kernels split along ``"model"`` by a layout map (Megatron's
column and row splits). Written as Keras code is: build and compile in the strategy's scope,
then `ls.Trainer(model).fit`. At the end the losses and weights are compared with the same code
on one device (and the losses with Keras' own `model.fit`, whose weights part from both after a
few Adam steps on the query and key kernels, whose gradients start near zero: a floor of Keras
against itself under another summation order, not of the mesh), and each device's bytes with
the replicated run's.

    python examples/sharded_transformer.py
"""

import codecs
import os
import contextlib
import io

os.environ.setdefault("KERAS_BACKEND", "jax")

import lockstep as ls  # noqa: E402

ls.simulate_cpu_devices(8)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers as L  # noqa: E402

SEQ, DIM, HEADS = 16, 32, 4


def corpus() -> tuple[np.ndarray, np.ndarray, int]:
    """(inputs, next-character targets, vocabulary size) from the Zen of Python."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
        import this
    text = codecs.decode(this.s, "rot13")
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], np.int32)
    starts = np.arange(0, len(ids) - SEQ - 1, 3)
    x = np.stack([ids[s:s + SEQ] for s in starts])
    y = np.stack([ids[s + 1:s + SEQ + 1] for s in starts])
    return x, y, len(chars)


def build(vocab: int) -> keras.Model:
    tokens = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(vocab, DIM, name="token_embedding")(tokens)
    h = h + L.Embedding(SEQ, DIM, name="position_embedding")(keras.ops.arange(SEQ))
    # no biases: the key bias gets no gradient (softmax ignores it), and Adam would turn rounding noise
    # into steps of the learning rate on it, on one device as on eight
    a = L.MultiHeadAttention(HEADS, DIM // HEADS, use_bias=False, name="attention")(h, h, use_causal_mask=True)
    h = L.LayerNormalization(name="norm_1")(h + a)
    f = L.Dense(4 * DIM, activation="gelu", name="ffn_in")(h)
    h = L.LayerNormalization(name="norm_2")(h + L.Dense(DIM, name="ffn_out")(f))
    return keras.Model(tokens, L.Dense(vocab, name="logits")(h))


def compiled(vocab: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = build(vocab)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def main() -> int:
    x, y, vocab = corpus()
    print(f"\n{len(x)} sequences of {SEQ} characters, vocabulary {vocab}")

    mesh = ls.DeviceMesh((2, 4), ("batch", "model"))
    layout = ls.LayoutMap(mesh)
    layout["attention/(query|key|value)/kernel"] = (None, "model", None)  # heads split: 4 heads, 1 per device
    layout["attention/attention_output/kernel"] = ("model", None, None)
    layout["ffn_in/kernel"] = (None, "model")  # column split
    layout["ffn_out/kernel"] = ("model", None)  # row split
    strategy = ls.ShardedStrategy(mesh=mesh, layout_map=layout, batch_dim_name="batch", zero_stage=3,
                                  min_shard_size=256)
    with strategy.scope():
        model = compiled(vocab)
    print("estimated bytes per device:", ls.memory_estimate(model, model.optimizer, strategy))
    trainer = ls.Trainer(model)
    history = trainer.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=2).history
    print(trainer.layouts.report())

    with ls.OneDeviceStrategy().scope():  # the same Keras code on one device
        one = ls.Trainer(compiled(vocab))
    want = one.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0).history
    keras_own = compiled(vocab).fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0).history
    weights = max(float(np.max(np.abs(a - b))) for a, b in zip(trainer.get_weights(), one.get_weights()))
    state = trainer.train_state
    per_device = sum(s.data.nbytes for leaf in jax.tree.leaves((state.params, state.opt_state))
                     for s in leaf.addressable_shards if s.device == jax.devices()[0])
    whole = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves((state.params, state.opt_state)))
    print(f"\nweights and Adam state: {per_device} bytes on device 0, {whole} replicated ({whole / per_device:.1f}x)")
    print(f"{'epoch':<6} {'2x4 mesh, ZeRO-3':>17} {'one device':>12} {'Keras fit':>10}")
    agree = weights < 1e-5
    for epoch, (got, ref, own) in enumerate(zip(history["loss"], want["loss"], keras_own["loss"])):
        agree &= abs(got - ref) <= 1e-6 * max(1.0, abs(ref)) and abs(got - own) <= 1e-4 * abs(own)
        print(f"{epoch:<6} {got:>17.6f} {ref:>12.6f} {own:>10.6f}")
    print(f"largest weight difference from one device: {weights:.2e}")
    print("sharded run and one device agree" if agree else "sharded run and one device DISAGREE")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
