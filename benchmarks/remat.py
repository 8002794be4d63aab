"""Activation checkpointing (`Trainer(remat=...)`) on a transformer: bytes the compiled step holds
and step time, with and without it, side by side in one run.

    python benchmarks/remat.py                 # writes benchmarks/REMAT.md
    python benchmarks/remat.py --quick         # a smoke run
    python benchmarks/remat.py --gpu           # GPT-2-small-shaped blocks in bf16: writes benchmarks/REMAT_GPU.md

Each mode trains the same Keras transformer (pre-norm blocks of multi-head attention and a GELU
MLP) with `Trainer.fit` on one device, in its own child process, the modes interleaved over rounds.
Memory is XLA's own accounting of the compiled training step (`Trainer.step_memory`: arguments,
outputs, temporaries; the activations are among the temporaries), the same in every round; time
is the median step of the epochs after the first, and its ratio to no remat within a round. Where the
device keeps allocator statistics (GPUs), its measured peak is reported too.
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
#: with --gpu also "offload" (the products' outputs kept in pinned host memory: an accelerator's)
GPU_MODES = [*MODES, "offload"]


#: seq, layers, batch, steps, epochs, width, heads, bf16 (Keras' mixed_bfloat16 policy)
SHAPES = {"default": (256, 6, 16, 8, 3, 128, 4, 0), "quick": (32, 2, 4, 4, 2, 128, 4, 0),
          "gpu": (1024, 12, 8, 32, 3, 768, 12, 1)}


def child(mode: str, seq: int, layers: int, batch: int, steps: int, epochs: int, width: int, heads: int,
          bf16: int) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import numpy as np

    import lockstep as ls

    started = time.perf_counter()
    if bf16:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inp = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(1000, width)(inp)
    for _ in range(layers):
        a = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.MultiHeadAttention(heads, width // heads)(a, a, use_causal_mask=True)
        f = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="gelu")(f))
    model = keras.Model(inp, keras.layers.Dense(1000, dtype="float32")(keras.layers.LayerNormalization()(h)))
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
    stats = jax.devices()[0].memory_stats() or {}
    memory = trainer.step_memory()
    # the step's temporaries that do not grow with the batch bound what of them is not activations
    at_one = trainer.step_memory(x[:batch], y[:batch], batch_size=1)["temporaries"]
    return {"step_s": statistics.median(times[1:]), "memory": memory,
            "loss": history.history["loss"][-1], "temporaries_at_batch_1": at_one, "measured_peak": stats.get("peak_bytes_in_use"),
            "device": jax.devices()[0].device_kind, "wall_s": time.perf_counter() - started}


def run_child(mode: str, *args: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, __file__, "--child", mode, *map(str, args)], capture_output=True,
                          text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip()[-600:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: dict[str, list[dict]], ratios: dict[str, list[float]], shape: tuple, rounds: int,
           command: str, seconds: float) -> list[str]:
    """The Markdown table of the rounds run so far."""
    seq, layers, batch, steps, epochs, width, heads, bf16 = shape
    base = results["none"][0]
    measured = base["measured_peak"] is not None
    device = base["device"]
    lines = ["# Activation checkpointing: bytes held by the training step and its time", "",
             f"Machine: {machine()}, one device: {device}. Command: `{command}`, {seconds:.0f} s; a Keras "
             f"transformer ({layers} pre-norm blocks, width {width}, {heads} heads, causal attention over {seq} "
             f"tokens, vocabulary 1000{', mixed_bfloat16' if bf16 else ''}), batch {batch}, Adam; {rounds} "
             f"interleaved round(s) of {epochs} epochs of {steps} steps (time: the median step of the epochs "
             "after the first).", "",
             "| remat | temporaries (MiB) | vs none | at batch 1 (MiB) | step peak (MiB) | vs none |"
             + (" measured peak (MiB) | vs none |" if measured else "")
             + " step time (s) | time ratio to none (range) | final loss |",
             "|---|---|---|---|---|---|" + ("---|---|" if measured else "") + "---|---|---|"]
    for m in results:
        mem, base_mem = results[m][0]["memory"], base["memory"]
        step = statistics.median(x["step_s"] for x in results[m])
        row = (f"| {m} | {mem['temporaries'] / 2**20:,.1f} | {mem['temporaries'] / base_mem['temporaries']:.2f} | "
               f"{results[m][0]['temporaries_at_batch_1'] / 2**20:,.1f} | "
               f"{mem['peak'] / 2**20:,.1f} | {mem['peak'] / base_mem['peak']:.2f} |")
        if measured:
            peak = results[m][0]["measured_peak"]
            row += f" {peak / 2**20:,.1f} | {peak / base['measured_peak']:.2f} |"
        lines.append(row + f" {step:.4f} | {statistics.median(ratios[m]):.2f} ({min(ratios[m]):.2f}-"
                     f"{max(ratios[m]):.2f}) | {results[m][0]['loss']:.4f} |")
    lines += ["", "Temporaries and step peak are XLA's accounting of the compiled step (`Trainer.step_memory()`). "
              "The activations are among the temporaries; \"at batch 1\" is the temporaries of the same step "
              "compiled for one row (`step_memory(x, y, batch_size=1)`): an upper bound on the temporaries that are "
              "not activations (gradients, the optimizer's update). The measured peak is the device allocator's "
              "`peak_bytes_in_use` over the whole run (GPUs only). The loss is the same in every row where the "
              "device's reductions are deterministic (CPU): remat changes what the step keeps, never a number."]
    if device == "cpu":
        lines += ["", "These are XLA's CPU compiler's numbers: its buffer assignment keeps much of what the "
                  "recomputation frees, so the bytes saved here are far from what a layer-wise remat gives on "
                  "an accelerator (`python benchmarks/remat.py --gpu`, REMAT_GPU.md)."]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=9, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="GPT-2-small-shaped blocks in bf16, for an accelerator")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=None, help="a comma-separated choice of the modes (none is always run)")
    parser.add_argument("--out", default=None, help="default: benchmarks/REMAT.md (REMAT_GPU.md with --gpu)")
    args = parser.parse_args()
    out = args.out or os.path.join(ROOT, "benchmarks", "REMAT_GPU.md" if args.gpu else "REMAT.md")
    if args.child:
        mode, *rest = args.child
        print(json.dumps(child(mode, *map(int, rest))))
        return 0
    shape = SHAPES["gpu" if args.gpu else "quick" if args.quick else "default"]
    rounds = 1 if args.quick else args.rounds
    started = time.perf_counter()
    modes = GPU_MODES if args.gpu else MODES
    if args.modes:
        chosen = set(args.modes.split(",")) | {"none"}
        if chosen - set(modes):
            parser.error(f"--modes: {sorted(chosen - set(modes))} not among {modes}")
        modes = [m for m in modes if m in chosen]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        got = {}
        for m in order:
            try:
                got[m] = run_child(m, *shape)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # reported, the other modes go on
                failed[m] = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
                print(m, "failed:", failed[m], flush=True)
        if "none" not in got:  # the baseline every ratio divides by
            raise SystemExit(f"remat=None failed: {failed['none']}")
        modes = [m for m in modes if m in got]
        for m in list(results):
            if m not in got:
                del results[m], ratios[m]
        for m in modes:
            results[m].append(got[m])
            ratios[m].append(got[m]["step_s"] / got["none"]["step_s"])
            print(m, f"round {r + 1}", got[m], flush=True)
        flags = (" --gpu" if args.gpu else " --quick" if args.quick else "") + (
            f" --rounds {args.rounds}" if not args.quick and args.rounds != 3 else "") + (
            f" --modes {args.modes}" if args.modes else "")
        lines = report(results, ratios, shape, r + 1, f"python benchmarks/remat.py{flags}",
                       time.perf_counter() - started)
        lines += [f"- remat={m!r} failed: {why}" for m, why in failed.items()]
        write_report(out, lines)  # after every round, so a run cut short keeps what it measured
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
