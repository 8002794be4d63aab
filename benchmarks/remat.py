"""Activation checkpointing (`Trainer(remat=...)`) on a transformer: bytes the compiled step holds
and step time, with and without it, side by side in one run.

    python benchmarks/remat.py                 # writes benchmarks/REMAT.md
    python benchmarks/remat.py --quick         # a smoke run

Each mode trains the same Keras transformer (pre-norm blocks of multi-head attention and a GELU
MLP) with `Trainer.fit` on one device, in its own child process, the modes interleaved over rounds.
Memory is XLA's own accounting of the compiled training step (`Trainer.step_memory`: arguments,
outputs, temporaries; the activations are among the temporaries), the same in every round; time
is the median step of the epochs after the first, and its ratio to no remat within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import machine, write_report  # noqa: E402

MODES = ["none", "full", "layers", "dots"]


def child(mode: str, seq: int, layers: int, batch: int, steps: int, epochs: int) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    import lockstep as ls

    width, heads = 128, 4
    keras.utils.set_random_seed(0)
    inp = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(1000, width)(inp)
    for _ in range(layers):
        a = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.MultiHeadAttention(heads, width // heads)(a, a, use_causal_mask=True)
        f = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="gelu")(f))
    model = keras.Model(inp, keras.layers.Dense(1000)(keras.layers.LayerNormalization()(h)))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, (batch * steps, seq)).astype("int32")
    y = rng.integers(0, 1000, (batch * steps, seq)).astype("int32")
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append((time.perf_counter() - self.start) / steps)

    trainer = ls.Trainer(model, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                         strategy=ls.MirroredStrategy(1), remat=None if mode == "none" else mode)
    history = trainer.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[Timer()])
    return {"step_s": statistics.median(times[1:]), "memory": trainer.step_memory(),
            "loss": history.history["loss"][-1]}


def run_child(mode: str, *args: int) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, __file__, "--child", mode, *map(str, args)], capture_output=True,
                          text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip()[-600:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "REMAT.md"))
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        print(json.dumps(child(mode, *map(int, rest))))
        return 0
    shape = (32, 2, 4, 4, 2) if args.quick else (256, 6, 16, 8, 3)  # seq, layers, batch, steps, epochs
    rounds = 1 if args.quick else args.rounds
    started = time.perf_counter()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        got = {m: run_child(m, *shape) for m in order}
        for m in MODES:
            results[m].append(got[m])
            ratios[m].append(got[m]["step_s"] / got["none"]["step_s"])
            print(m, f"round {r + 1}", got[m], flush=True)
    base = results["none"][0]["memory"]
    seq, layers, batch, steps, epochs = shape
    lines = ["# Activation checkpointing: bytes held by the training step and its time", "",
             f"Machine: {machine()}, one CPU device. Command: `python benchmarks/remat.py"
             f"{' --quick' if args.quick else ''}`, {time.perf_counter() - started:.0f} s; a Keras transformer "
             f"({layers} blocks, width 128, 4 heads, causal attention over {seq} tokens, vocabulary 1000), batch "
             f"{batch}, Adam; {rounds} interleaved round(s) of {epochs} epochs of {steps} steps (time: the median "
             "step of the epochs after the first).", "",
             "| remat | temporaries (MiB) | vs none | peak (MiB) | vs none | step time (s) | time ratio to none (range) "
             "| final loss |", "|---|---|---|---|---|---|---|---|"]
    for m in MODES:
        mem = results[m][0]["memory"]
        step = statistics.median(x["step_s"] for x in results[m])
        lines.append(f"| {m} | {mem['temporaries'] / 2**20:.1f} | {mem['temporaries'] / base['temporaries']:.2f} | "
                     f"{mem['peak'] / 2**20:.1f} | {mem['peak'] / base['peak']:.2f} | {step:.3f} | "
                     f"{statistics.median(ratios[m]):.2f} ({min(ratios[m]):.2f}-{max(ratios[m]):.2f}) | "
                     f"{results[m][0]['loss']:.4f} |")
    lines += ["", "Bytes are XLA's accounting of the compiled step (`Trainer.step_memory()`); the same loss in "
              "every row: remat changes what the step keeps, never a number. These are XLA's CPU compiler's "
              "numbers: its buffer assignment keeps much of what the recomputation frees, so the bytes saved "
              "here are far from the 2x a layer-wise remat gives on accelerators; no GPU was available to "
              "measure that (benchmarks/gpu.py is the place)."]
    write_report(args.out, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
