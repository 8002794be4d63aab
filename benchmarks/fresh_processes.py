"""The spread of small steps over fresh processes (issue 42): `steps_per_execution` k = 32 against
k = 1 and the hand-written loop at batch 16 on one device, each process new.

    python benchmarks/fresh_processes.py               # 10 fresh processes
    python benchmarks/fresh_processes.py --processes 3

Each process is `small_steps.py`'s child (the same MLP, data and systems): a compiling epoch of
each system, then `--rounds` timed epochs in a rotated order. The table gives, per system, the
epoch time of each process (its median over the rounds) and, per process, k = 32's time over
k = 1's and over the hand loop's. A process whose k = 32 epoch is not faster than its k = 1 epoch
is counted: it would be a run that did not fuse its steps, or did not keep its data on the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import machine  # noqa: E402
from small_steps import run_child  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    rows = []
    for i in range(args.processes):
        run = run_child(["jax", "1", str(args.batch), str(args.rounds)])
        if isinstance(run, str):
            print(f"process {i + 1}: {run}", flush=True)
            continue
        med = {name: statistics.median(ts) for name, ts in run["times"].items()}
        rows.append(med)
        print(f"process {i + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()), flush=True)
    if not rows:
        return 1
    print(f"\n{machine()}; batch {args.batch}, 1 device, {len(rows)} fresh processes, median of {args.rounds} "
          "epochs each\n")
    print("| system | epoch s: min / median / max |\n|---|---|")
    for name in rows[0]:
        vals = sorted(r[name] for r in rows)
        print(f"| {name} | {vals[0]:.3f} / {statistics.median(vals):.3f} / {vals[-1]:.3f} |")
    k32_k1 = sorted(r["lockstep_k32"] / r["lockstep_k1"] for r in rows)
    k32_hand = sorted(r["lockstep_k32"] / r["hand"] for r in rows)
    print(f"\nk = 32 / k = 1 per process: {', '.join(f'{v:.2f}' for v in k32_k1)}")
    print(f"k = 32 / hand loop per process: {', '.join(f'{v:.2f}' for v in k32_hand)}")
    print(f"processes where k = 32 was not faster than k = 1: {sum(v >= 1 for v in k32_k1)} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
