"""Backups written in the background (`BackupAndRestore(async_save=True)`, the default; and
`ModelCheckpoint`'s files, `--modes weights-sync,weights-async`) against
synchronous ones and none: how much a backup stalls training, side by side in one run.

    python benchmarks/backups.py             # writes benchmarks/BACKUPS.md
    python benchmarks/backups.py --quick     # a smoke run
    python benchmarks/backups.py --gpu       # on an accelerator: writes benchmarks/BACKUPS_GPU.md

`--gpu` trains `benchmarks/gpu.py`'s GPT-2-small-shaped transformer (mixed_bfloat16, sequence 1024,
vocabulary 50257, batch 8; 124 M parameters, 1.5 GB of state with Adam's) instead of the MLP.

Each mode trains the same MLP (about 64 MB of weights and Adam state) with `Trainer.fit` on one
device, a backup every `--every` steps, in its own child process, the modes interleaved over
rounds. A step's time is the wall time between the ends of consecutive steps; the stall of a mode
is its median epoch time over that of no backups, within a round, and the steps that follow a
backup are reported apart (the save itself, and the steps during which it is written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import machine, write_report  # noqa: E402

MODES = ["none", "sync", "async", "weights-sync", "weights-async"]
LABELS = {"none": "none", "sync": "synchronous (`async_save=False`)",
          "async": "in the background (`async_save=True`, default)",
          "weights-sync": "`ModelCheckpoint(save_weights_only=True, async_save=False)`, .npz",
          "weights-async": "`ModelCheckpoint(save_weights_only=True)` (background, default), .npz"}


def child(mode: str, width: int, batch: int, steps: int, epochs: int, every: int, gpt: int = 0) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    import lockstep as ls

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if gpt:  # the transformer of benchmarks/gpu.py, `gpt` blocks of `width`
        from gpu import build

        keras.config.set_dtype_policy("mixed_bfloat16")
        seq, vocab = (1024, 50257) if width >= 768 else (32, 256)
        model = build(keras, gpt, width, max(1, width // 64), seq, vocab)
        data = rng.integers(0, vocab, (batch * steps, seq + 1)).astype("int32")
        x, y = data[:, :-1], data[:, 1:]
    else:
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)])
        x = rng.normal(size=(batch * steps, 784)).astype("float32")
        y = rng.integers(0, 10, batch * steps)
    ends: list[float] = []
    epoch_times: list[float] = []
    in_backups: list[float] = []

    class Timer(ls.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self.start)

    writes: list[tuple[float, float]] = []  # (start, end) of each backup's write, on whichever thread
    write = ls.checkpoint.TrainingCheckpointer._write

    def timed_write(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return write(self, *args, **kwargs)
        finally:
            writes.append((start, time.perf_counter()))
    ls.checkpoint.TrainingCheckpointer._write = timed_write
    trainer = ls.Trainer(model, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                         strategy=ls.OneDeviceStrategy())
    callbacks: list = [Timer()]
    with tempfile.TemporaryDirectory() as backup_dir:
        if mode.startswith("weights"):  # ModelCheckpoint: the weights alone, one file a save
            backup = ls.callbacks.ModelCheckpoint(os.path.join(backup_dir, "w.npz"), save_weights_only=True,
                                                  save_freq=every, async_save=mode == "weights-async")
        elif mode != "none":
            backup = ls.callbacks.BackupAndRestore(backup_dir, save_freq=every, async_save=mode == "async")
        if mode != "none":
            hook = backup.on_train_batch_end

            def timed(batch, logs=None):  # the time the training thread spends in the backup's hook
                start = time.perf_counter()
                hook(batch, logs)
                in_backups.append(time.perf_counter() - start)
            backup.on_train_batch_end = timed
            callbacks.insert(0, backup)
        trainer.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=callbacks)
    state_bytes = sum(np.asarray(w).nbytes for w in model.weights) * (1 if mode.startswith("weights") else 3)  # + Adam
    step_times = [b - a for a, b in zip(ends, ends[1:])][steps:]  # after the first epoch (compiling)
    # the interval after the end of step s holds the save of step s (BackupAndRestore's hooks run last)
    after_backup = [t for i, t in enumerate(step_times) if (i + steps + 1) % every == 0]
    others = [t for i, t in enumerate(step_times) if (i + steps + 1) % every != 0]
    saves = [t for t in in_backups if t > 1e-3] or [0.0]
    # steps that end while a backup is being written (in the background), the save's own step apart
    steps_ends = list(zip(step_times, ends[steps + 1:]))
    writing = [t for i, (t, end) in enumerate(steps_ends) if (i + steps + 1) % every != 0
               and any(a < end and end - t < b for a, b in writes)]
    return {"epoch_s": statistics.median(epoch_times[1:]), "state_mb": state_bytes / 2**20,
            "in_save_ms": 1e3 * statistics.median(saves),
            "step_after_backup_ms": 1e3 * statistics.median(after_backup),
            "step_other_ms": 1e3 * statistics.median(others),
            "step_while_written_ms": 1e3 * statistics.median(writing) if writing else None,
            "steps_while_written": len(writing),
            "step_while_written_mean_ms": 1e3 * statistics.fmean(writing) if writing else None,
            "step_mean_ms": 1e3 * statistics.fmean(others),
            # where an epoch's time goes beyond its median step: the excess of the steps overlapping a write, and
            # the slowest of them as (steps after the save, ms)
            "excess_while_written_s": sum(t - statistics.median(others) for t in writing),
            "slowest_while_written": sorted(((i + steps + 1) % every, round(1e3 * t, 1)) for i, (t, end)
                                            in enumerate(steps_ends) if t in sorted(writing)[-5:])
                                     if writing else [],
            "write_s": statistics.median(b - a for a, b in writes) if writes else 0.0,
            "device": __import__("jax").devices()[0].device_kind}


_EXPLAINED = ("The training thread's time in a save is what `BackupAndRestore`'s hook takes when it saves "
    "(synchronous: it waits for the steps queued before the save, whose state it saves, and writes; "
    "in the background: it hands the arrays to the writer thread). A step's time is the wall time "
    "between the ends of consecutive steps; \"a step with a save\" is the one in which a backup is "
    "saved (steps are dispatched ahead, so it also holds the steps queued before it). \"A write\" is the "
    "time `TrainingCheckpointer` takes to write one backup (checksums and orbax's save; on the writer "
    "thread in the background), and \"a step while one is written\" the median of the other steps that "
    "overlap a write, over that of the steps without backups (and their mean: a few slow steps move "
    "the mean, not the median). On a 2-core machine "
    "the background writer (checksums, orbax's tensorstore write) shares the 2 cores with the training "
    "step, so what is left of the stall in the epoch time is CPU time, not waiting: with the step on an "
    "accelerator the host's cores are free for it.")


def _table(results: dict[str, list[dict]], every: int) -> list[str]:
    base = [res["epoch_s"] for res in results["none"]]
    base_step = [res["step_other_ms"] for res in results["none"]]
    lines = ["| backups | state written | epoch s (median) | epoch time / no backups (range) | training thread "
             "in a save, ms | a step with a save, ms | other steps, ms | a write, s | a step while one is written, "
             "ms: median (/ a step without backups); mean |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in results:
        rows = results[mode]
        ratios = [res["epoch_s"] / b for res, b in zip(rows, base)]
        during = [(r["step_while_written_ms"], r["step_while_written_ms"] / b) for r, b in zip(rows, base_step)
                  if r.get("step_while_written_ms") is not None]
        means = [r["step_while_written_mean_ms"] for r in rows if r.get("step_while_written_mean_ms") is not None]
        written = (f"{statistics.median(d for d, _ in during):.1f} ({statistics.median(q for _, q in during):.3f}, "
                   f"{min(q for _, q in during):.3f}-{max(q for _, q in during):.3f}); mean "
                   f"{statistics.median(means):.1f}" if during else "-")
        label = LABELS[mode]
        lines.append(f"| {label} | {rows[0]['state_mb']:.0f} MB every {every} steps | "
                     f"{statistics.median(r['epoch_s'] for r in rows):.3f} | {statistics.median(ratios):.3f} "
                     f"({min(ratios):.3f}-{max(ratios):.3f}) | {statistics.median(r['in_save_ms'] for r in rows):.1f} | "
                     f"{statistics.median(r['step_after_backup_ms'] for r in rows):.1f} | "
                     f"{statistics.median(r['step_other_ms'] for r in rows):.1f} | "
                     f"{statistics.median(r.get('write_s', 0.0) for r in rows):.2f} | {written} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="the GPT-2-small-shaped transformer, for an accelerator")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", default="8,32", help="steps between backups (a table for each)")
    parser.add_argument("--steps", type=int, default=None, help="steps an epoch (default 32; 128 with --gpu)")
    parser.add_argument("--modes", default=",".join(MODES), help="which of " + ", ".join(MODES))
    parser.add_argument("--out", default=None, help="default: benchmarks/BACKUPS.md (BACKUPS_GPU.md with --gpu)")
    args = parser.parse_args()
    out = args.out or os.path.join(ROOT, "benchmarks", "BACKUPS_GPU.md" if args.gpu else "BACKUPS.md")
    if args.child:
        mode, *numbers = args.child
        print(json.dumps(child(mode, *map(int, numbers))))
        return 0
    if args.gpu:  # blocks, width, batch, steps, epochs
        gpt, width, batch, steps, epochs = (2, 64, 4, 8, 2) if args.quick else (12, 768, 8, 128, 3)
    else:
        gpt, (width, batch, steps, epochs) = 0, ((256, 64, 8, 2) if args.quick else (2048, 256, 32, 4))
    steps = args.steps or steps
    cadences = [4] if args.quick else [int(e) for e in args.every.split(",")]
    rounds = 1 if args.quick else args.rounds
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "KERAS_BACKEND": "jax"}
    tables: list[str] = []
    model = (f"`benchmarks/gpu.py`'s transformer ({gpt} blocks of width {width}, mixed_bfloat16)" if gpt
             else f"an MLP (784-{width}-{width}-10)")
    flags = "".join(f" {f}" for f, on in (("--gpu", args.gpu), ("--quick", args.quick)) if on)
    flags += "" if args.every == "8,32" or args.quick else f" --every {args.every}"
    flags += "" if args.modes == ",".join(MODES) else f" --modes {args.modes}"
    flags += "" if args.rounds == 3 or args.quick else f" --rounds {args.rounds}"
    flags += f" --steps {args.steps}" if args.steps else ""
    for every in cadences:
        modes = ["none", *[m for m in args.modes.split(",") if m != "none"]]
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in modes:
                done = subprocess.run([sys.executable, __file__, "--child", mode, str(width), str(batch), str(steps),
                                      str(epochs), str(every), str(gpt)], capture_output=True, text=True, env=env)
                if done.returncode:
                    raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
                results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(mode, every, f"round {r + 1}", results[mode][-1], flush=True)
            table = [f"### A backup every {every} steps ({r + 1} round(s))", "", *_table(results, every), ""]
            report = ["# Backups in the background: how much a backup stalls training", "",
                      f"Machine: {machine()}; device: {results['none'][0]['device']}. Command: "
                      f"`python benchmarks/backups.py{flags}`, {time.perf_counter() - started:.0f} s; {model} "
                      f"trained with Adam by `Trainer.fit` on one device, batch {batch}, {steps} steps an epoch, "
                      f"{epochs} epochs (the first, compiling, left out), `BackupAndRestore(save_freq=...)`; "
                      f"{rounds} interleaved round(s), each mode in its own process, medians.", "", *tables, *table,
                      _EXPLAINED]
            write_report(out, report)  # after every round, so a run cut short keeps what it measured
        tables += table
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
