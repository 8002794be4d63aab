"""lockstep's own fit, before and after a change, side by side in one run.

    python benchmarks/before_after.py --before fff2061      # writes benchmarks/BEFORE_AFTER.md

The commit `--before` is checked out in a temporary git worktree; each round runs `bench.py`'s
lockstep fit child once with that tree's `lockstep` and once with this tree's (in a rotated
order), on the same data, model and simulated device count. Reported per model and device
count: samples/s of the median epoch after the first for each, and the median (and range) over
rounds of the after/before ratio of samples/s and of CPU time per epoch (both within a round, so
a slow spell of a shared machine hits both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench.py")


def run(tree: str, model: str, devices: int, n: int, epochs: int, batch: int) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "XLA_FLAGS": "", "KERAS_BACKEND": "jax"}
    args = ["fit", "lockstep", model, str(devices), str(n), str(epochs), str(batch)]
    proc = subprocess.run([sys.executable, BENCH, "--child", *args], capture_output=True, text=True, env=env,
                          timeout=1800, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare with (say, main's before a change)")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--devices", default="1,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=256, help="the global batch size")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "BEFORE_AFTER.md"))
    args = parser.parse_args()
    epochs = {"mlp": 6, "cnn": 3}
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", old, args.before], check=True,
                       capture_output=True)
        try:
            rows = []
            for model in args.models.split(","):
                for devices in [int(d) for d in args.devices.split(",")]:
                    speed, cpu, runs = [], [], {"before": [], "after": []}
                    for rnd in range(args.rounds):
                        order = [("before", old), ("after", ROOT)]
                        got = {name: run(tree, model, devices, args.samples, epochs[model], args.batch)
                               for name, tree in (order if rnd % 2 == 0 else order[::-1])}
                        for name in got:
                            runs[name].append(got[name])
                        speed.append(got["after"]["samples_per_s"] / got["before"]["samples_per_s"])
                        cpu.append(got["before"]["cpu_s_per_epoch"] / got["after"]["cpu_s_per_epoch"])
                        print(model, devices, f"round {rnd + 1}", f"speed {speed[-1]:.3f}", f"cpu {cpu[-1]:.3f}",
                              flush=True)
                    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()}
                    rows.append(f"| {model} | {devices} | {med['before']:,.0f} | {med['after']:,.0f} | "
                                f"{statistics.median(speed):.3f} ({min(speed):.3f}-{max(speed):.3f}) | "
                                f"{statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) |")
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old], capture_output=True)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    lines = ["# lockstep fit before and after a change", "",
             f"Command: `python benchmarks/before_after.py --before {args.before} --batch {args.batch} --samples "
             f"{args.samples} --rounds {args.rounds} --models {args.models}` (after: {head.strip()}, with the "
             f"working tree's changes); {args.samples} samples, global batch {args.batch}, {args.rounds} rounds in "
             "rotated order, simulated CPU devices.", "",
             "| model | devices | before samples/s | after samples/s | speed ratio after/before (range) | "
             "CPU-time ratio before/after (range) |", "|---|---|---|---|---|---|", *rows, "",
             "Ratios above 1: the change is faster (or uses less CPU time per epoch)."]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
