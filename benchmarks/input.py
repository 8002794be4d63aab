"""Input pipelines: a Grain pipeline through lockstep against Grain alone, and bytes read per worker.

    python benchmarks/input.py            # writes benchmarks/INPUT.md (part of `make bench`)

* throughput: a `grain.MapDataset` of 20,000 MNIST-shaped samples stored as raw bytes, decoded
  (uint8 -> float32, scaled) per sample, batched 256 at a time: Grain alone (`ds.batch(256)`,
  iterated) against the same pipeline through `strategy.experimental_distribute_dataset(
  ls.data.IndexedBatches(ds, 256))` (read, stack, pad, place on the devices), one process, on 1
  and 4 simulated CPU devices; interleaved rounds, medians.
* bytes read: 2 worker processes (`lockstep launch`), one pass each way: lockstep's per-worker
  reading (`IndexedBatches`), and whole global batches (`ds.batch(256)` given to
  `experimental_distribute_dataset`, every worker reading every sample and keeping its rows, as
  lockstep did before).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import ROOT, machine, write_report  # noqa: E402

N, BATCH = 20000, 256


class RawImages:
    """A data source of raw uint8 images (784 bytes) and labels; counts the bytes it hands out."""

    def __init__(self, n: int = N):
        import numpy as np

        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, size=(n, 784), dtype=np.uint8)
        self.labels = rng.integers(0, 10, size=n).astype(np.int32)
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        self.bytes_read += self.images[i].nbytes + self.labels[i].nbytes
        return self.images[i], self.labels[i]


def pipeline(source):
    import grain
    import numpy as np

    return grain.MapDataset.source(source).map(lambda s: ((s[0].astype(np.float32) - 127.5) / 127.5, s[1]))


def child_throughput(system: str, devices: int) -> dict:
    import lockstep as ls

    ls.simulate_cpu_devices(devices)
    import jax

    ds = pipeline(RawImages())
    strategy = ls.MirroredStrategy(devices)
    times = []
    for _ in range(3):  # the first pass warms up (imports, first placement)
        start = time.perf_counter()
        if system == "grain":
            for batch in ds.batch(BATCH):
                pass
        else:
            last = None
            for last in strategy.experimental_distribute_dataset(ls.data.IndexedBatches(ds, BATCH)):
                pass
            jax.block_until_ready(last.data)
        times.append(time.perf_counter() - start)
    return {"samples_per_s": N / statistics.median(times[1:])}


def worker_bytes(mode: str, out_dir: str) -> None:
    import lockstep as ls

    strategy = ls.MultiWorkerMirroredStrategy()
    source = RawImages()
    ds = pipeline(source)
    data = ls.data.IndexedBatches(ds, BATCH) if mode == "per_worker" else ds.batch(BATCH)
    steps = sum(1 for _ in strategy.experimental_distribute_dataset(data))
    with open(os.path.join(out_dir, f"{mode}{strategy.cluster_resolver.task_id}.json"), "w") as f:
        json.dump({"bytes": source.bytes_read, "steps": steps}, f)


def run(args: list[str], launch: int = 0) -> dict | str:
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "", "KERAS_BACKEND": "jax"}
    cmd = [sys.executable, __file__, "--child", *args]
    if launch:
        cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", str(launch), *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        return f"failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]) if not launch else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "INPUT.md"))
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "bytes":
            worker_bytes(args.child[1], args.child[2])
        else:
            print(json.dumps(child_throughput(args.child[1], int(args.child[2]))))
        return 0
    started = time.perf_counter()
    lines = ["# Input pipelines", "", f"Machine: {machine()}. Command: `python benchmarks/input.py` (`make bench`).", "",
             f"## Throughput: {N} samples of 784 raw bytes decoded per sample, batch {BATCH}; {args.rounds} "
             "interleaved rounds, median of passes 2-3 in each", "",
             "| devices | Grain alone (samples/s) | Grain through lockstep (samples/s) | ratio (range) |", "|---|---|---|---|"]
    for devices in (1, 4):
        runs: dict = {"grain": [], "lockstep": []}
        for rnd in range(args.rounds):
            for system in (["grain", "lockstep"] if rnd % 2 == 0 else ["lockstep", "grain"]):
                r = run(["throughput", system, str(devices)])
                runs[system].append(r)
                print(devices, system, r, flush=True)
        pairs = [(a, b) for a, b in zip(runs["lockstep"], runs["grain"]) if isinstance(a, dict) and isinstance(b, dict)]
        ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
        lines.append(f"| {devices} | {statistics.median(b['samples_per_s'] for _, b in pairs):,.0f} | "
                     f"{statistics.median(a['samples_per_s'] for a, _ in pairs):,.0f} | "
                     f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    lines += ["", "Grain alone stacks batches on the host; through lockstep the same samples are also padded and "
              "placed on the devices, split over replicas.", "",
              "## Bytes read per worker: 2 worker processes, one pass", "",
              "| reading | worker 0 (MB) | worker 1 (MB) | steps | all samples (MB) |", "|---|---|---|---|---|"]
    total = RawImages().images.nbytes / 1e6 + N * 4 / 1e6
    for mode, label in (("per_worker", "lockstep `IndexedBatches` (each worker its rows)"),
                        ("whole", "whole global batches (`ds.batch(256)`), before")):
        with tempfile.TemporaryDirectory() as out:
            r = run(["bytes", mode, out], launch=2)
            if isinstance(r, str):
                lines.append(f"| {label} | {r} | | | |")
                continue
            res = [json.load(open(os.path.join(out, f"{mode}{w}.json"))) for w in (0, 1)]
            lines.append(f"| {label} | {res[0]['bytes'] / 1e6:.2f} | {res[1]['bytes'] / 1e6:.2f} | {res[0]['steps']} | "
                         f"{total:.2f} |")
            print(mode, res, flush=True)
    lines += ["", f"Written in {time.perf_counter() - started:.0f} s. Per-worker reading adds one read of "
              "sample 0 per worker (the shapes)."]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
