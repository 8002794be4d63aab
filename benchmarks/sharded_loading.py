"""Loading a model into a sharded strategy: the most any device holds while the model is built in
the scope and its weights are loaded, against its shards plus the largest variable.

    python benchmarks/sharded_loading.py      # writes benchmarks/SHARDED_LOADING.md

An MLP of about 20 MB (its largest variable 16 MB) under `ShardedStrategy` ZeRO-3 on 8 simulated
CPU devices, each way of loading in a fresh process. A thread reads every live JAX array's shards
every millisecond and keeps each device's largest total (CPU devices report no memory statistics),
so a transient copy shorter than a millisecond can be missed; the pass before the loading
(building) is measured alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import machine, write_report  # noqa: E402

WAYS = ["build in the scope (nothing loaded)", "model.load_weights (.weights.h5)", "keras.models.load_model (.keras)",
        "model.set_weights (NumPy)"]


def child(way: int, directory: str) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import collections
    import threading

    import jax
    import keras
    import numpy as np

    import lockstep as ls

    def model():
        return keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048, name="a"),
                                 keras.layers.Dense(2048, name="b"), keras.layers.Dense(10, name="c")])
    strategy = ls.ShardedStrategy(mesh=ls.DeviceMesh((8, 1), ("batch", "model")), zero_stage=3)
    if way < 0:  # the files the ways load, written once
        saved = model()
        saved.save_weights(os.path.join(directory, "m.weights.h5"))
        saved.save(os.path.join(directory, "m.keras"))
        np.savez(os.path.join(directory, "m.npz"), *saved.get_weights())
        return {}
    weights = None if way != 3 else list(np.load(os.path.join(directory, "m.npz")).values())
    peaks = {"building": collections.Counter(), "loading": collections.Counter()}
    phase = ["building"]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            now: collections.Counter = collections.Counter()
            for a in jax.live_arrays():
                try:
                    for s in a.addressable_shards:
                        now[s.device.id] += int(np.prod(s.data.shape)) * a.dtype.itemsize
                except Exception:  # noqa: BLE001 - an array deleted meanwhile
                    pass
            peak = peaks[phase[0]]
            for d, b in now.items():
                peak[d] = max(peak[d], b)
            time.sleep(0.001)
    watcher = threading.Thread(target=poll)
    watcher.start()
    with strategy.scope():
        if way == 2:  # building and loading in one call
            phase[0] = "loading"
            loaded = keras.models.load_model(os.path.join(directory, "m.keras"))
        else:
            loaded = model()
            time.sleep(0.01)  # the poller's last reading of the building
            phase[0] = "loading"
            if way == 1:
                loaded.load_weights(os.path.join(directory, "m.weights.h5"))
            elif way == 3:
                loaded.set_weights(weights)
    done.set()
    watcher.join()
    sizes = [int(np.prod(v.shape)) * 4 for v in loaded.weights]
    shards = sum(s.data.nbytes for v in loaded.weights for s in v.value.addressable_shards if s.device.id == 0)
    return {"building": [peaks["building"][d] for d in range(8)], "loading": [peaks["loading"][d] for d in range(8)],
            "shards": shards, "largest": max(sizes), "total": sum(sizes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "SHARDED_LOADING.md"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1])))
        return 0
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": ROOT, "KERAS_BACKEND": "jax"}
    mib = 2**20
    lines = ["| way | model | device 0's shards | largest variable | most a device held building | most a device "
             "held loading (device 0 / the others) | loading / (shards + largest) |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as directory:
        subprocess.run([sys.executable, __file__, "--child", "-1", directory], env=env, check=True,
                       capture_output=True)
        for way, name in enumerate(WAYS):
            out = subprocess.run([sys.executable, __file__, "--child", str(way), directory], capture_output=True,
                                 text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(name, r, flush=True)
            built, load = max(r["building"]), max(r["loading"])
            lines.append(f"| {name} | {r['total'] / mib:.2f} MiB | {r['shards'] / mib:.2f} MiB | "
                         f"{r['largest'] / mib:.2f} MiB | {built / mib:.2f} MiB | {load / mib:.2f} MiB "
                         f"({r['loading'][0] / mib:.2f} / {max(r['loading'][1:]) / mib:.2f}) | "
                         f"{load / (r['shards'] + r['largest']):.2f} |")
    report = ["# Loading into a sharded strategy: the most a device holds", "",
              f"Machine: {machine()}. Command: `python benchmarks/sharded_loading.py`, "
              f"{time.perf_counter() - started:.0f} s; a Keras MLP (512-2048-2048-10) under "
              "`ShardedStrategy(DeviceMesh((8, 1)), zero_stage=3)` on 8 simulated CPU devices, each way in a "
              "fresh process; the goal: at most 1.1 x (a device's shards + the largest variable).", "", *lines, "",
              "A thread reads every live JAX array's shards each millisecond (CPU devices keep no memory "
              "statistics) and keeps each device's largest total, while the model is built in the scope and then "
              "while its weights are loaded (`load_model` does both in one call). Keras initialises a variable whole on the default device (device 0) unless "
              "it is 250 MB or more over the mesh, then lays it out: so building holds one whole variable (and "
              "its initialiser's temporaries) at a time there. Loaded values go from the host straight into their shards (lockstep's scope; "
              "before, Keras made each loaded value whole on the default device first)."]
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
