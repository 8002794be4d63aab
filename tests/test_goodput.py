"""`lockstep.callbacks.Goodput`: throughput counts real rows only (a replica holding none
included), the step time's parts add up and land where the time went (a slow pipeline, a slow
callback, backups), FLOPs per step match a hand count, MFU is FLOP/s over the peak."""

import time

import keras
import numpy as np
import pytest

import lockstep as ls
from lockstep.callbacks import Goodput

N, BATCH = 13, 8  # padded to 16 rows an epoch on 4 replicas; the last batch leaves replica 3 without rows


def _mlp(width=8):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(3)])


def _data(n=N):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def _fit(model, x, y, callbacks, **kw):
    trainer = ls.Trainer(model, loss="sparse_categorical_crossentropy_from_logits", strategy=ls.MirroredStrategy(4))
    history = trainer.fit(x, y, epochs=2, verbose=0, callbacks=callbacks, **kw).history
    return trainer, history


def test_samples_are_the_real_rows_and_the_parts_add_up_to_the_step():
    x, y = _data()
    goodput = Goodput()
    _, history = _fit(_mlp(), x, y, [goodput], batch_size=BATCH)
    for epoch in goodput.epochs:
        steps = 2  # 13 rows in batches of 8
        assert epoch["samples_per_s"] * epoch["step_s"] * steps == pytest.approx(N, rel=1e-9)  # not 16
        parts = epoch["input_s"] + epoch["host_s"] + epoch["checkpoint_s"] + epoch["compute_s"]
        assert parts == pytest.approx(epoch["step_s"], rel=1e-9)
        assert "tokens_per_s" not in epoch and "mfu" not in epoch  # not a sequence; CPU: no known peak
    assert history["samples_per_s"] == [e["samples_per_s"] for e in goodput.epochs]  # in the fit's logs


def test_the_time_lands_where_it_went():
    x, y = _data(48)

    def slow_batches():
        for i in range(0, 48, BATCH):
            time.sleep(0.05)
            yield x[i:i + BATCH], y[i:i + BATCH]

    class Slow(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.03)

    goodput = Goodput()
    _fit(_mlp(), list(slow_batches()), None, [goodput, Slow()])  # a list: no waiting
    fast = goodput.epochs[-1]
    goodput = Goodput()
    _fit(_mlp(), _Reiterable(slow_batches), None, [goodput])
    waited = goodput.epochs[-1]
    assert waited["input_s"] >= 0.025 and waited["input_s"] > fast["input_s"]
    assert fast["host_s"] >= 0.03 and fast["host_s"] > waited["host_s"]


class _Reiterable:
    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return self.make()


def test_backups_count_as_checkpoint_time(tmp_path):
    x, y = _data()
    goodput = Goodput()
    _fit(_mlp(), x, y, [goodput, ls.callbacks.BackupAndRestore(str(tmp_path), save_freq=1)], batch_size=BATCH)
    assert goodput.epochs[-1]["checkpoint_s"] > 0


def test_flops_per_step_match_a_hand_count_and_mfu_is_over_the_peak():
    """A step of Dense(512 -> 512) on 64 rows: 2 x rows x weights FLOPs forward and as many for the
    weights' gradient (the input's is not taken), on one device's 16 rows of the 4 replicas'."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 512)).astype("float32"), rng.normal(size=(64, 512)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(512, use_bias=False)])
    goodput = Goodput(peak_flops=1e12)
    trainer = ls.Trainer(model, optimizer="sgd", loss="mse", strategy=ls.MirroredStrategy(4))
    trainer.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[goodput])
    epoch = goodput.epochs[-1]
    assert epoch["flops_per_step"] == 4 * 16 * 512 * 512
    assert epoch["flop_per_s"] == pytest.approx(epoch["flops_per_step"] / epoch["step_s"])
    assert epoch["mfu"] == pytest.approx(epoch["flop_per_s"] / 1e12)


@pytest.mark.parametrize("steps_per_execution, accumulation", [(4, 1), (1, 2), (4, 2)])
def test_flops_per_step_count_every_step_and_batch_of_a_looped_program(steps_per_execution, accumulation):
    """A program of several steps (a loop over them) or of several batches a step (gradient
    accumulation, a loop over the batches) reports one optimizer step's FLOPs: the hand count of
    every batch of the step (XLA's cost analysis, used before, counted a loop's body once: the
    FLOPs of 4 steps came out as a quarter of one's)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 256)).astype("float32"), rng.normal(size=(128, 256)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256, use_bias=False)])
    goodput = Goodput()
    trainer = ls.Trainer(model, optimizer="sgd", loss="mse", strategy=ls.MirroredStrategy(2),
                         steps_per_execution=steps_per_execution, gradient_accumulation_steps=accumulation)
    trainer.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[goodput])
    hand = accumulation * 4 * 16 * 256 * 256  # each batch: 16 rows a replica, forward and the weights' gradient
    assert goodput.epochs[-1]["flops_per_step"] == hand


def test_convolution_flops_match_a_hand_count():
    """Conv2D(3x3, 4 -> 8, 'same') on 8x8 images: 2 x outputs x (3 x 3 x 4) forward and as many for
    the kernel's gradient, on one device's 8 rows of the 2 replicas' 16 (the step is a `shard_map`
    over the replicas: each shard counted once, the sum shared by the 2 devices)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8, 8, 4)).astype("float32"), rng.normal(size=(16, 8, 8, 8)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(8, 3, padding="same", use_bias=False)])
    goodput = Goodput()
    trainer = ls.Trainer(model, optimizer="sgd", loss="mse", strategy=ls.MirroredStrategy(2))
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[goodput])
    assert goodput.epochs[-1]["flops_per_step"] == 2 * 2 * (8 * 8 * 8 * 8) * (3 * 3 * 4)


def test_sequences_report_tokens():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (12, 10)).astype("int32"), rng.integers(0, 3, 12)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,), dtype="int32"), keras.layers.Embedding(50, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    goodput = Goodput()
    _fit(model, x, y, [goodput], batch_size=8)
    epoch = goodput.epochs[-1]
    assert epoch["tokens_per_s"] == pytest.approx(10 * epoch["samples_per_s"])


@pytest.mark.parametrize("layout", [0, 1])
def test_a_fused_attention_kernel_counts_its_products(layout):
    """cuDNN's fused attention (what Keras' attention runs on a GPU) is one primitive in the jaxpr,
    not matrix products: its FLOPs are counted from its shapes, 4 x B x N x T x S x H forward and
    twice that backward (the GPT-2 benchmark on an H100 missed the attention's 0.93e12 of a step's
    7.0e12 without it). The primitive is jax's own (`jax._src.cudnn`), bound abstractly on CPU."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from lockstep.training._flops import matmul_flops

    B, N, T, S, H = 2, 3, 5, 7, 4
    q, kv = ((B, N, T, H), (B, N, S, H)) if layout == 1 else ((B, T, N, H), (B, S, N, H))
    none = jax.ShapeDtypeStruct((0,), "float32")
    args = [jax.ShapeDtypeStruct(q, "bfloat16"), *[jax.ShapeDtypeStruct(kv, "bfloat16")] * 2, none,
            *[jax.ShapeDtypeStruct((B,), "int32")] * 2, *[none] * 4]
    params = dict(scale=1.0, seed=0, dropout_rate=0.0, variadic_args=(False, False), mask_type=0, layout=layout,
                  sliding_window_length=None)
    fwd = jax.make_jaxpr(lambda *a: fa._dot_product_attention_fwd_p_wrapper.bind(*a, is_training=True, **params))
    assert matmul_flops(fwd(*args)) == 4 * B * N * T * S * H
    out = jax.ShapeDtypeStruct(q, "bfloat16")
    bwd = jax.make_jaxpr(lambda *a: fa._dot_product_attention_bwd_p_wrapper.bind(*a, **params))
    assert matmul_flops(bwd(*args, jax.ShapeDtypeStruct((B, N, T), "float32"), out, out)) == 8 * B * N * T * S * H
