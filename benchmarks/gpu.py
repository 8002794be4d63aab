"""A GPT-2-small-shaped Keras transformer on one accelerator: lockstep's `model.fit` (steps_per_execution
1 and 32) against a hand-written `jax.jit` loop and Keras' own `fit`, side by side in one run.

    python benchmarks/gpu.py                  # on a GPU: writes benchmarks/GPU.md
    python benchmarks/gpu.py --smoke          # tiny shapes on CPU, in one process (run by the test suite)
    JAX_PLATFORMS=cuda python benchmarks/gpu.py --smoke   # the same tiny shapes on the GPU

Model: 12 pre-norm blocks, width 768, 12 heads, causal attention over 1024 tokens, vocabulary
50257, GELU MLP of 3072, Keras' `mixed_bfloat16` policy, AdamW; batch 8 sequences. Every system
trains the same model from the same weights on the same random tokens, each in its own child
process (one after the other, the order rotated each round). Reported per system: tokens/s of the
median epoch after the first, its ratio to the hand-written loop, and MFU: the model FLOPs per token
(PaLM's count, 6 N + 12 L d T) times tokens/s over the device's dense bf16 peak
(`lockstep.callbacks._goodput.PEAK_FLOPS`; none on CPU). lockstep's rows also report what its
`Goodput` callback logs (FLOPs per step: the matrix products of the compiled step, counted from its
jaxpr, and MFU from those), and its `Trainer.step_memory()["device_peak"]` beside the device's measured peak
(`memory_stats()["peak_bytes_in_use"]`, where the device keeps allocator statistics: GPUs, not CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ["hand-written jax.jit loop", "Keras fit", "lockstep fit (k = 1)", "lockstep fit (k = 32)"]
FULL = dict(layers=12, width=768, heads=12, seq=1024, vocab=50257, batch=8, steps=64, epochs=3)
SMOKE = dict(layers=2, width=64, heads=4, seq=32, vocab=256, batch=4, steps=4, epochs=2)


def build(keras, layers, width, heads, seq, vocab):
    """The transformer, its weights drawn from seed 0."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    class Positions(keras.layers.Layer):  # GPT-2's learned position embedding
        def build(self, shape):
            self.table = self.add_weight(shape=(shape[1], shape[2]), initializer="random_normal")

        def call(self, h):
            return h + keras.ops.cast(self.table, h.dtype)[None]

    h = Positions()(keras.layers.Embedding(vocab, width)(tokens))
    for _ in range(layers):
        a = keras.layers.LayerNormalization(epsilon=1e-5)(h)
        h = h + keras.layers.MultiHeadAttention(heads, width // heads)(a, a, use_causal_mask=True)
        f = keras.layers.LayerNormalization(epsilon=1e-5)(h)
        h = h + keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="gelu")(f))
    logits = keras.layers.Dense(vocab, dtype="float32")(keras.layers.LayerNormalization(epsilon=1e-5)(h))
    return keras.Model(tokens, logits)


def child(system: str, shape: dict) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import numpy as np

    import lockstep as ls

    keras.config.set_dtype_policy("mixed_bfloat16")
    n = shape["batch"] * shape["steps"]
    rng = np.random.default_rng(0)
    data = rng.integers(0, shape["vocab"], (n, shape["seq"] + 1)).astype("int32")
    x, y = data[:, :-1], data[:, 1:]
    dims = {k: shape[k] for k in ("layers", "width", "heads", "seq", "vocab")}
    times: list[float] = []
    extra: dict = {}
    if system.startswith("hand"):
        import optax

        model = build(keras, **dims)
        opt = optax.adamw(1e-4, eps=1e-7, weight_decay=0.004)
        tv, ntv = [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]
        state = opt.init(tv)

        def loss_fn(tv, xb, yb):
            logits, _ = model.stateless_call(tv, ntv, xb, training=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype("float32"), yb).mean()

        @jax.jit
        def step(tv, state, xb, yb):
            loss, grads = jax.value_and_grad(loss_fn)(tv, xb, yb)
            updates, state = opt.update(grads, state, tv)
            return optax.apply_updates(tv, updates), state, loss

        b = shape["batch"]
        for _ in range(shape["epochs"]):
            start = time.perf_counter()
            for i in range(shape["steps"]):
                tv, state, loss = step(tv, state, x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
        final = float(loss)
    else:
        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                times.append(time.perf_counter() - self.start)

        class StepMemory(ls.callbacks.Callback):  # lockstep's estimate of the compiled step's device peak
            def on_train_end(self, logs=None):
                extra["step_memory"] = self.trainer.step_memory()

        k = 32 if "32" in system else 1
        in_lockstep = system.startswith("lockstep")
        scope = ls.MirroredStrategy(1).scope() if in_lockstep else _nothing()
        with scope:
            model = build(keras, **dims)
            model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=k)
        callbacks = [Timer(), ls.callbacks.Goodput(), StepMemory()] if in_lockstep else [Timer()]
        history = model.fit(x, y, batch_size=shape["batch"], epochs=shape["epochs"], shuffle=False, verbose=0,
                            callbacks=callbacks)
        final = history.history["loss"][-1]
        for key in ("flops_per_step", "mfu"):
            if key in history.history:
                extra["goodput_" + key] = history.history[key][-1]
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    epoch_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    stats = jax.devices()[0].memory_stats() or {}
    return {"tokens_per_s": n * shape["seq"] / epoch_s, "step_s": epoch_s / shape["steps"], "params": params,
            "loss": final, "device": jax.devices()[0].device_kind, "peak_bytes": stats.get("peak_bytes_in_use"),
            **extra}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_child(system: str, shape: dict, env: dict) -> dict | str:
    proc = subprocess.run([sys.executable, __file__, "--child", system, json.dumps(shape)], capture_output=True,
                          text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        return "failed: " + ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1][:200]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, a few steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default=None, help="a comma-separated choice of the systems' numbers (1-4)")
    parser.add_argument("--out", default=None, help="default: benchmarks/GPU.md (--smoke, --systems: print only)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return 0
    sys.path.insert(0, ROOT)
    from lockstep.callbacks._goodput import peak_flops

    shape = SMOKE if args.smoke else FULL
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "KERAS_BACKEND": "jax"}
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX_PLATFORMS=cuda runs the smoke shapes on the GPU
        os.environ["KERAS_BACKEND"] = "jax"
    rounds = 1 if args.smoke else args.rounds
    started = time.perf_counter()
    chosen = [SYSTEMS[int(i) - 1] for i in args.systems.split(",")] if args.systems else SYSTEMS
    got: dict[str, list] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        for system in [s for s in SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)] if s in chosen]:
            # --smoke: in this process (a few seconds each); otherwise each system in a fresh process
            got[system].append(child(system, shape) if args.smoke else run_child(system, shape, env))
            print(system, f"round {r + 1}", got[system][-1], flush=True)
    ok = {s: [x for x in v if isinstance(x, dict)] for s, v in got.items()}
    failed = [s for s, v in ok.items() if not v]
    if failed:
        print("failed:", failed, {s: got[s] for s in failed}, file=sys.stderr)
    if not ok[chosen[0]]:
        return 1
    first = ok[chosen[0]][0]
    L, d, T = shape["layers"], shape["width"], shape["seq"]
    flops_per_token = 6 * first["params"] + 12 * L * d * T
    peak = peak_flops(first["device"])
    hand = statistics.median(x["tokens_per_s"] for x in ok[SYSTEMS[0]]) if ok[SYSTEMS[0]] else float("nan")
    lines = ["# A GPT-2-small-shaped transformer on one device: lockstep fit, a hand-written loop, Keras fit", "",
             f"Device: {first['device']} ({platform.node() or 'this machine'}); command: `python benchmarks/gpu.py"
             f"{' --smoke' if args.smoke else ''}`, {time.perf_counter() - started:.0f} s; {L} blocks, width {d}, "
             f"{shape['heads']} heads, sequence {T}, vocabulary {shape['vocab']}, batch {shape['batch']}, "
             f"{first['params']:,} parameters, mixed_bfloat16, AdamW; {rounds} round(s) of {shape['epochs']} epochs "
             f"of {shape['steps']} steps (the median epoch after the first).", "",
             "| system | tokens/s | step (ms) | ratio to the hand-written loop | MFU | final loss | measured peak (MiB) |",
             "|---|---|---|---|---|---|---|"]
    mib = lambda b: f"{b / 2**20:,.0f}" if b else "-"  # noqa: E731
    for system in chosen:
        if not ok[system]:
            lines.append(f"| {system} | {got[system][0]} | | | | | |")
            continue
        tps = statistics.median(x["tokens_per_s"] for x in ok[system])
        step = statistics.median(x["step_s"] for x in ok[system])
        mfu = f"{tps * flops_per_token / peak:.1%}" if peak else "- (no known peak)"
        lines.append(f"| {system} | {tps:,.0f} | {step * 1e3:.1f} | {tps / hand:.2f} | {mfu} | "
                     f"{ok[system][0]['loss']:.4f} | {mib(ok[system][0]['peak_bytes'])} |")
    lines += ["", f"MFU: {flops_per_token / 1e6:.1f} MFLOPs per token (6 N + 12 L d T) times tokens/s over "
              f"{'%.0f TFLOP/s' % (peak / 1e12) if peak else 'the device peak (unknown here)'}.", "",
              "lockstep's own figures, from its `Goodput` callback (the step's matrix products, counted from its jaxpr) and "
              "`Trainer.step_memory()`, against the analytic count and the device's measured peak:", "",
              "| system | FLOPs/step, Goodput | FLOPs/step, 6 N + 12 L d T | Goodput MFU | step_memory device_peak (MiB) "
              "| measured peak (MiB) | estimate / measured |", "|---|---|---|---|---|---|---|"]
    for system in [s for s in chosen if s.startswith("lockstep")]:
        if not ok[system]:
            continue
        x = ok[system][0]
        est = (x.get("step_memory") or {}).get("device_peak")
        mfu = f"{x['goodput_mfu']:.1%}" if "goodput_mfu" in x else "-"
        ratio = f"{est / x['peak_bytes']:.2f}" if est and x["peak_bytes"] else "-"
        lines.append(f"| {system} | {x.get('goodput_flops_per_step', 0):.3e} | "
                     f"{flops_per_token * shape['batch'] * T:.3e} | {mfu} | {mib(est)} | {mib(x['peak_bytes'])} "
                     f"| {ratio} |")
    table = "\n".join(lines) + "\n"
    out = args.out or (None if args.smoke or args.systems else os.path.join(ROOT, "benchmarks", "GPU.md"))
    if out:
        with open(out, "w") as f:
            f.write(table)
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
