"""The cost of drawing a Keras model's randomness as one device draws it.

    python benchmarks/random_draws.py            # writes benchmarks/RANDOM_DRAWS.md
    python benchmarks/random_draws.py --quick    # fewer samples and rounds, for a smoke run

Inside a replica, lockstep draws a Keras layer's random values (a `Dropout` mask, noise) for the
whole global batch and keeps the replica's rows (`lockstep/keras/_layers.py`,
`random_draws_as_one_device`): the step is then one device's, on any replica count. Dropout masks
and normal / uniform draws start their counters at the replica's first row (no more bits than its
own rows'); other draws generate the whole batch's bits. This compares, side by side in fresh
processes, an epoch of `model.fit` of a 784-512-512-10 MLP with two `Dropout(0.2)` layers on R
simulated CPU devices (global batch 256) with the draws made so ("one device's") and with each
replica drawing its own rows alone ("rows alone": the cost of the per-replica draws lockstep made
before; its masks are not one device's). Each round runs both in a rotated order; the table gives
the median epoch (after a compiling epoch) and the ratio within rounds.
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
MODES = ("one device's", "rows alone")


def child(mode: str, replicas: int, samples: int, epochs: int) -> None:
    import contextlib

    import lockstep as ls

    ls.simulate_cpu_devices(replicas)
    import keras
    import numpy as np

    from lockstep.keras import _model

    if mode == "rows alone":  # each replica draws its own rows only (not one device's masks)
        _model.random_draws_as_one_device = lambda *_: contextlib.nullcontext()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(samples, 784)).astype("float32"), np.arange(samples) % 10
    keras.utils.set_random_seed(0)
    with ls.MirroredStrategy(replicas).scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=256, epochs=1, verbose=0)  # compiles
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        model.fit(x, y, batch_size=256, epochs=1, verbose=0)
        times.append(time.perf_counter() - start)
    print("RESULT", json.dumps({"epoch_s": statistics.median(times)}))


def run(mode: str, replicas: int, samples: int, epochs: int) -> float:
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(replicas), str(samples), str(epochs)],
                         capture_output=True, text=True, timeout=600, env=env, check=True)
    line = next(li for li in out.stdout.splitlines() if li.startswith("RESULT "))
    return float(json.loads(line[len("RESULT "):])["epoch_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=4)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "RANDOM_DRAWS.md"))
    args = parser.parse_args()
    if args.child:
        mode, replicas, samples, epochs = args.child
        child(mode, int(replicas), int(samples), int(epochs))
        return
    samples, epochs, rounds = (2048, 1, 1) if args.quick else (8192, 3, 3)
    rows = []
    for replicas in (2, 4):
        seen: dict[str, list[float]] = {m: [] for m in MODES}
        ratios = []
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            got = {m: run(m, replicas, samples, epochs) for m in order}
            for m in MODES:
                seen[m].append(got[m])
            ratios.append(got[MODES[0]] / got[MODES[1]])
        rows.append(f"| {replicas} | {statistics.median(seen[MODES[0]]):.3f} | {statistics.median(seen[MODES[1]]):.3f} "
                    f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    table = "\n".join([
        "| replicas | one device's draws: epoch s | rows alone: epoch s | ratio (range) |",
        "|---|---|---|---|", *rows])
    text = (f"# Random draws as one device's: their cost\n\nCommand: `python benchmarks/random_draws.py"
            f"{' --quick' if args.quick else ''}`; {samples} samples, global batch 256, {rounds} rounds, "
            f"simulated CPU devices.\n\n{table}\n")
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
