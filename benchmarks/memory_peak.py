"""What lockstep says a device holds against what the process measurably held (issue 43, item 5).

    python benchmarks/memory_peak.py            # writes benchmarks/MEMORY_PEAK.md
    python benchmarks/memory_peak.py --quick    # a smoke run

CPU devices have no allocator statistics (`device.memory_stats()` is None), so the peak is measured
as the process's: each row runs in a child process with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``: every buffer XLA allocates is mapped when made and unmapped when
freed, so the resident set follows the buffers alive). After the first epoch (which compiles), a
callback reads the resident set and the bytes of the arrays alive on the devices, and resets the
kernel's high-water mark (``/proc/self/clear_refs``); at the end of the last epoch it reads the
high-water mark. A device's measured peak is the bytes alive on device 0 after epoch 1 (each
buffer once) + (high-water mark - resident set then) / devices: every device of a row does the
same work on equal shares.

Against it, per row (all per device):

* ``memory_estimate(model, "adam", strategy)``, worked out before anything is placed: parameters
  + optimizer state (+ a step's gradients: its "total");
* ``Trainer.step_memory()["peak"]``: XLA's accounting of the compiled training program (its
  arguments: the state and the device's share of the epoch's rows; its outputs: the next state,
  in the state's buffers, which the step takes over (donated: counted once); its temporaries:
  activations, gradients, gathered parameters);
* ``Trainer.step_memory()["device_peak"]``: that and the Keras model's own variables where each
  device holds them beside the training state (``keras_variables``: one more copy of the parameters,
  or of its shards, with a sharded state; none with a replicated one, whose `fit` lends the Keras
  variables the state itself);
* ``Trainer.step_memory(x, y, batch_size=64)["device_peak"]`` asked before `fit`, before the
  trainer's state is placed: the step compiled from the state's shapes where they would lie, and
  the Keras variables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import machine, run_script, write_report  # noqa: E402

DEVICES = 8
#: row name -> (mesh shape (batch, model) or (replica, batch, model), or None for MirroredStrategy; ZeRO stage)
SYSTEMS = {
    "data parallel (MirroredStrategy)": (None, 0),
    "ZeRO-1 (8 x 1)": ((8, 1), 1),
    "ZeRO-2 (8 x 1)": ((8, 1), 2),
    "ZeRO-3 (8 x 1)": ((8, 1), 3),
    "HSDP: 2 copies x ZeRO-3 over 4 (2 x 4 x 1)": ((2, 4, 1), 3),
}
MODELS = {"mlp": "MLP 784-2048-2048-10 (5.8 M parameters)",
          "transformer": "transformer, 2 blocks, d 256, sequence 128 (1.7 M parameters)"}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _on_device_0() -> int:
    """Bytes of the buffers alive on device 0 (each once: a shard's array and its whole array share one)."""
    import jax

    device, seen, total = jax.devices()[0], set(), 0
    for a in jax.live_arrays():
        for s in a.addressable_shards:
            if s.device == device and s.data.unsafe_buffer_pointer() not in seen:
                seen.add(s.data.unsafe_buffer_pointer())
                total += s.data.nbytes
    return total


def build(model: str):
    import keras

    keras.utils.set_random_seed(0)
    if model == "mlp":
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(2048, activation="relu"),
                                 keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
    inputs = keras.Input((128,), dtype="int32")
    h = keras.layers.Embedding(1000, 256)(inputs)
    for _ in range(2):
        a = keras.layers.MultiHeadAttention(4, 64)(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(1024, activation="gelu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(256)(f))
    return keras.Model(inputs, keras.layers.Dense(1000)(h))


def child(system: str, model_name: str, n: int, epochs: int) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    import lockstep as ls

    ls.simulate_cpu_devices(DEVICES)
    import numpy as np

    shape, stage = SYSTEMS[system]
    if shape is None:
        strategy = ls.MirroredStrategy(DEVICES)
    else:
        mesh = ls.DeviceMesh(shape, ("replica", "batch", "model")[3 - len(shape):])
        strategy = ls.ShardedStrategy(mesh=mesh, zero_stage=stage, min_shard_size=1,
                                      replica_dim_name="replica" if len(shape) == 3 else None)
    rng = np.random.default_rng(0)
    if model_name == "mlp":
        x, y = rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)
    else:
        x, y = (rng.integers(0, 1000, (n, 128)).astype(np.int32) for _ in range(2))
    with strategy.scope():
        model = build(model_name)
    marks: dict = {}

    class Peak(ls.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            import jax

            jax.block_until_ready(self.trainer.current_state().params)  # (not `train_state`: a copy)
            if epoch == 0:
                gc.collect()
                marks["on_device_0"], marks["rss"] = _on_device_0(), _status("VmRSS")
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # the high-water mark starts again from the resident set
            elif epoch == epochs - 1:
                marks["hwm"] = _status("VmHWM")

    trainer = ls.Trainer(model, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits", strategy=strategy)
    ahead = trainer.step_memory(x, y, batch_size=64)  # before the state is placed: compiled from its shapes
    trainer.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0, callbacks=[Peak()])
    estimate = ls.memory_estimate(model, "adam", strategy)
    rise = (marks["hwm"] - marks["rss"]) / DEVICES
    return {"estimate_state": estimate["parameters"] + estimate["optimizer_state"], "estimate_total": estimate["total"],
            "step": trainer.step_memory(), "ahead": ahead, "measured": marks["on_device_0"] + rise, "on_device_0": marks["on_device_0"],
            "rise": rise}


def run_child(system: str, model: str, n: int, epochs: int) -> dict | str:
    return run_script(__file__, [system, model, str(n), str(epochs)], env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=4, metavar=("SYSTEM", "MODEL", "N", "EPOCHS"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        system, model, n, epochs = args.child
        print(json.dumps(child(system, model, int(n), int(epochs))))
        return 0
    n, epochs, rounds = (256, 2, 1) if args.quick else (1024, 3, args.rounds)
    mib = 2 ** 20
    lines = ["# `memory_estimate` and XLA's step accounting against the measured peak", "",
             f"Machine: {machine()}. Command: `python benchmarks/memory_peak.py{' --quick' if args.quick else ''}`; "
             f"{n} samples, batch 64, {epochs} epochs (the peak measured over epochs 2-{epochs}), Adam, "
             f"{DEVICES} simulated CPU devices, each row in a fresh process, {rounds} round(s) (the median measured).",
             "", __doc__.split("\n\n", 2)[2].strip(), ""]
    for model in MODELS:
        lines += [f"## {MODELS[model]}", "",
                  "| system | memory_estimate: params + Adam | memory_estimate: total | XLA's peak of the step | "
                  "+ Keras variables = device_peak | measured peak | device_peak / measured | "
                  "before placing: device_peak / measured | "
                  "measured: held after epoch 1 + rise in epochs 2.. |", "|---|---|---|---|---|---|---|---|---|"]
        for system in SYSTEMS:
            runs = [run_child(system, model, n, epochs) for _ in range(rounds)]
            failed = [r for r in runs if isinstance(r, str)]
            if failed:
                lines.append(f"| {system} | {failed[0]} | | | | | | | |")
                continue
            r = runs[0]
            measured = statistics.median(x["measured"] for x in runs)
            step = r["step"]
            lines.append(f"| {system} | {r['estimate_state'] / mib:.2f} MiB | {r['estimate_total'] / mib:.2f} MiB | "
                         f"{step['peak'] / mib:.2f} MiB | + {step['keras_variables'] / mib:.2f} = "
                         f"{step['device_peak'] / mib:.2f} MiB | {measured / mib:.2f} MiB | "
                         f"{step['device_peak'] / measured:.3f} | {r['ahead']['device_peak'] / mib:.2f} MiB: "
                         f"{r['ahead']['device_peak'] / measured:.3f} | "
                         f"{r['on_device_0'] / mib:.2f} + {r['rise'] / mib:.2f} MiB |")
            print(lines[-1], flush=True)
        lines.append("")
    write_report(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "MEMORY_PEAK_QUICK.md" if args.quick else "MEMORY_PEAK.md"), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
