"""Small steps: where the host's work per step decides, lockstep against a hand-written loop and Keras.

    python benchmarks/small_steps.py            # writes benchmarks/SMALL_STEPS.md
    python benchmarks/small_steps.py --quick    # fewer rounds and batches, for a smoke run

A 784-128-10 MLP (Adam, sparse cross-entropy from logits, accuracy) on 8,000 synthetic
MNIST-shaped samples, global batches of 8, 16 and 32, on 1 and 4 simulated CPU devices. One child
process per device count and batch runs, in interleaved rounds (each round in a rotated order),
one epoch of each of: (b) a hand-written jitted JAX + optax loop (`bench.py`'s: one step a call,
batches indexed and placed from the host), (a) lockstep `Trainer.fit` with
``steps_per_execution`` k = 1, 8 and 32. A second child runs (c) Keras 3 `fit` (on 4 devices with
`keras.distribution.DataParallel`) compiled with its own ``steps_per_execution`` 1 and 32. Each
system's ratio to (b) is taken within a round (Keras': against (b)'s median, being in another
process); the table gives the median and range over rounds. Each epoch is timed from its first
to its last step's end, after a first (compiling) epoch.

The breakdown times one more epoch of lockstep with k = 1 and of (b), cut into parts by wrappers
around the functions that do them (µs per step; the wrappers add a little). On CPU devices the
device's work runs on the host's cores, often inline in the call that dispatches it (or in a
transfer that waits for it), so those parts hold device time too.
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
from bench import EpochTimer, HandLoop, keras_model, machine, make_data  # noqa: E402

N = 8000
LOCKSTEP_KS = (1, 8, 32)
KERAS_KS = (1, 32)


def _lockstep_epoch(ls, trainer, x, y, batch, seed):
    """One epoch of `trainer.fit`: its wall time from the epoch's start to its last step's end."""
    import jax

    times = EpochTimer()

    class Timer(ls.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times.begin()

        def on_epoch_end(self, epoch, logs=None):
            jax.block_until_ready(self.trainer.train_state.params)
            times.end()

    trainer.fit(x, y, batch_size=batch, epochs=1, shuffle=True, seed=seed, verbose=0, callbacks=[Timer()])
    return times.ends[0][0] - times.starts[0][0]


def _hand_epoch(hand, seed, parts=None):
    """One epoch of the hand-written loop: its wall time to its last step's end."""
    import jax

    t0 = time.perf_counter()
    hand.epoch(seed, parts)
    jax.block_until_ready(hand.tv)
    return time.perf_counter() - t0


def _breakdown(ls, trainer, x, y, batch):
    """µs per step of lockstep's host work in one epoch with k = 1, by part."""
    from lockstep.callbacks._callback_list import CallbackList
    from lockstep.engine._compiler import RunCompiler
    from lockstep.training import _trainer
    from lockstep.training._step_runner import StepRunner

    call = "the call: its arguments, dispatch, the device's work run inline"
    parts = {k: 0.0 for k in ("data: the next call's batches (stream, layout)", call, "waiting for the device",
                              "callbacks and lazy logs", "the loop, the state")}
    clock = time.perf_counter
    originals = (_trainer.executions, StepRunner.run, RunCompiler._track, CallbackList.__getattr__)

    def executions(*a, **k):
        it = originals[0](*a, **k)
        while True:
            t = clock()
            item = next(it, None)
            parts["data: the next call's batches (stream, layout)"] += clock() - t
            if item is None:
                return
            yield item

    def timed(fn, name):
        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                parts[name] += clock() - t
        return wrapper

    def getattr_(self, name):
        hook = originals[3](self, name)
        if name.startswith("on_train_batch"):
            hook = timed(hook, "callbacks and lazy logs")
            setattr(self, name, hook)  # as CallbackList keeps the hooks it binds
        return hook

    _trainer.executions = executions
    StepRunner.run = timed(originals[1], call)
    RunCompiler._track = timed(originals[2], "waiting for the device")
    CallbackList.__getattr__ = getattr_
    try:
        wall = _lockstep_epoch(ls, trainer, x, y, batch, 99)
    finally:
        _trainer.executions, StepRunner.run, RunCompiler._track, CallbackList.__getattr__ = originals
    parts[call] -= parts["waiting for the device"]  # the call includes the wait
    parts["the loop, the state"] = wall - sum(v for k, v in parts.items() if k != "the loop, the state")
    steps = -(-len(x) // batch)
    return {k: 1e6 * v / steps for k, v in parts.items()}, 1e6 * wall / steps


def child_jax(devices: int, batch: int, rounds: int) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    import lockstep as ls

    ls.simulate_cpu_devices(devices)
    x, y = make_data(N, "mlp")
    strategy = ls.MirroredStrategy(devices)
    trainers = {}
    for k in LOCKSTEP_KS:
        with strategy.scope():
            km = keras_model("mlp")
        trainers[k] = ls.Trainer(km, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                                 metrics=["accuracy"], steps_per_execution=k)
    hand = HandLoop("mlp", devices, x, y, batch)
    systems = {"hand": lambda seed: _hand_epoch(hand, seed)}
    systems.update({f"lockstep_k{k}": (lambda seed, t=t: _lockstep_epoch(ls, t, x, y, batch, seed))
                    for k, t in trainers.items()})
    for run in systems.values():  # the compiling epoch
        run(0)
    times = {name: [] for name in systems}
    names = list(systems)
    for rnd in range(rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[name].append(systems[name](rnd + 1))
    hand_parts = {k: 0.0 for k in (HandLoop.DATA, HandLoop.CALL, HandLoop.WAIT)}
    hand_wall = _hand_epoch(hand, 99, hand_parts)
    steps = -(-N // batch)
    lock_parts, lock_wall = _breakdown(ls, trainers[1], x, y, batch)
    return {"times": times, "breakdown": {"lockstep_k1": [lock_parts, lock_wall],
                                          "hand": [{k: 1e6 * v / steps for k, v in hand_parts.items()},
                                                   1e6 * hand_wall / steps]}}


def child_keras(devices: int, batch: int, rounds: int) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    import lockstep as ls

    ls.simulate_cpu_devices(devices)
    import jax
    import keras

    if devices > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:devices]))
    x, y = make_data(N, "mlp")
    models = {}
    for k in KERAS_KS:
        km = keras_model("mlp")
        km.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=["accuracy"], steps_per_execution=k)
        models[k] = km

    def epoch(km):
        times = EpochTimer()

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                times.begin()

            def on_epoch_end(self, epoch, logs=None):
                times.end()
        km.fit(x, y, batch_size=batch, epochs=1, shuffle=True, verbose=0, callbacks=[Timer()])
        return times.ends[0][0] - times.starts[0][0]

    for km in models.values():
        epoch(km)
    times = {f"keras_k{k}": [] for k in models}
    for rnd in range(rounds):
        ks = list(models)
        for k in ks[rnd % len(ks):] + ks[:rnd % len(ks)]:
            times[f"keras_k{k}"].append(epoch(models[k]))
    return {"times": times}


def run_child(args: list[str]) -> dict | str:
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          timeout=3600, env=env)
    if proc.returncode != 0:
        if "Termination timeout" in proc.stderr:  # XLA's CPU collectives: too many steps in flight
            return "failed: deadlocked (XLA's CPU collective rendezvous timed out and aborted the process)"
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed: {tail[0][:200]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


LABELS = {"hand": "(b) hand-written JAX + optax loop", "lockstep_k1": "(a) lockstep fit, k = 1",
          "lockstep_k8": "(a) lockstep fit, k = 8", "lockstep_k32": "(a) lockstep fit, k = 32",
          "keras_k1": "(c) Keras 3 fit, k = 1", "keras_k32": "(c) Keras 3 fit, k = 32"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 rounds, batch 16 only (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--devices", default="1,4")
    parser.add_argument("--batches", default="8,16,32")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "SMALL_STEPS.md"))
    args = parser.parse_args()
    if args.child:
        kind, devices, batch, rounds = args.child
        fn = child_jax if kind == "jax" else child_keras
        print(json.dumps(fn(int(devices), int(batch), int(rounds))))
        return 0
    rounds = 2 if args.quick else args.rounds
    batches = [16] if args.quick else [int(b) for b in args.batches.split(",")]
    lines = ["# Small steps", "", f"Machine: {machine()}.", "",
             f"Command: `python benchmarks/small_steps.py{' --quick' if args.quick else ''}`. MLP 784-128-10, {N} "
             f"samples, one epoch per system per round, {rounds} interleaved rounds; samples/s of the median epoch, "
             "and the ratio to (b) within each round (median, range). k: `steps_per_execution`.", "",
             "| devices | batch | system | samples/s | ratio to (b) (range) |", "|---|---|---|---|---|"]
    breakdowns = []
    for devices in [int(d) for d in args.devices.split(",")]:
        for batch in batches:
            jax_run = run_child(["jax", str(devices), str(batch), str(rounds)])
            keras_run = run_child(["keras", str(devices), str(batch), str(rounds)])
            print(devices, batch, jax_run, keras_run, flush=True)
            if isinstance(jax_run, str):
                lines.append(f"| {devices} | {batch} | all | {jax_run} | |")
                continue
            times = dict(jax_run["times"])
            if isinstance(keras_run, dict):
                times.update(keras_run["times"])
            hand = times["hand"]
            for name, ts in times.items():
                if name.startswith("keras"):
                    ratios = [statistics.median(hand) / t for t in ts]
                else:
                    ratios = [h / t for h, t in zip(hand, ts)]
                lines.append(f"| {devices} | {batch} | {LABELS[name]} | {N / statistics.median(ts):,.0f} | "
                             f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
            if isinstance(keras_run, str):
                lines.append(f"| {devices} | {batch} | (c) Keras 3 fit | {keras_run} | |")
            breakdowns.append((devices, batch, jax_run["breakdown"]))
    lines += ["", "Keras' ratios are to (b)'s median epoch (another process). Each lockstep epoch is a `fit` call: it "
              "includes placing the training arrays on the devices once (lockstep keeps in-memory data that fits "
              "there and gathers each step's rows in the compiled step).", "",
              "## Host time per step (µs), one more epoch", ""]
    for devices, batch, bd in breakdowns:
        lines += [f"### {devices} device{'s' if devices > 1 else ''}, batch {batch}", "",
                  "| system | part | µs per step |", "|---|---|---|"]
        for name, (parts, wall) in bd.items():
            for part, us in parts.items():
                lines.append(f"| {LABELS[name]} | {part} | {us:.1f} |")
            lines.append(f"| {LABELS[name]} | **the step, all told** | **{wall:.1f}** |")
        lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
