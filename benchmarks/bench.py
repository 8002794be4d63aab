"""Side-by-side benchmarks: lockstep against the systems users would pick instead.

    python benchmarks/bench.py            # the whole matrix; writes benchmarks/RESULTS.md
    python benchmarks/bench.py --quick    # fewer samples, for a smoke run

Every measurement runs in its own child process (so simulated devices and peak memory are its
own), all from this one parent, on the same device count and the same global batch:

* fit: a 784-128-10 MLP and a small CNN on 20,000 synthetic MNIST-shaped samples, global batch
  256, on 1 and 4 simulated CPU devices: (a) lockstep.Trainer.fit, (b) a hand-written jitted
  JAX + optax data-parallel loop (the practical limit), (c) Keras 3 fit with
  keras.distribution.DataParallel on JAX, (d) tf.distribute.MirroredStrategy with Keras fit
  when TensorFlow is importable. Reported: samples/s of the median epoch after the first, the
  ratio to (b), the ratio of CPU time per epoch, start-up time to the end of the first step, and
  peak resident memory. The systems run in interleaved rounds (--rounds, default 5), each in a
  rotated order; each ratio is taken within a round, and the table gives medians and the range
  of the ratio, since a shared machine's speed drifts.
* exact evaluation (masks) against the same evaluation without masks;
* reading a collection of 10 metrics in one reduction against reading them one by one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ["lockstep", "jax_loop", "keras", "tf"]
BN_SYSTEMS = ["lockstep", "lockstep_per_replica", "keras"]
LABELS = {"lockstep": "(a) lockstep Trainer.fit", "lockstep_per_replica": "(a') lockstep, per-replica statistics", "jax_loop": "(b) hand-written JAX + optax loop",
          "keras": "(c) Keras 3 fit + DataParallel", "tf": "(d) tf.distribute MirroredStrategy + Keras fit"}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def make_data(n: int, model: str):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.random((n, 28, 28, 1) if model.startswith("cnn") else (n, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=n).astype(np.int32)
    return x, y


def keras_model(model: str):
    import keras

    keras.utils.set_random_seed(0)
    if model == "cnn_bn":  # the CNN with BatchNorm after each convolution
        return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3), keras.layers.BatchNormalization(),
                                 keras.layers.ReLU(), keras.layers.MaxPooling2D(2), keras.layers.Conv2D(32, 3),
                                 keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.MaxPooling2D(2),
                                 keras.layers.Flatten(), keras.layers.Dense(10)])
    if model == "cnn":
        return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                                 keras.layers.MaxPooling2D(2), keras.layers.Conv2D(32, 3, activation="relu"),
                                 keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                                 keras.layers.Dense(10)])
    return keras.Sequential([keras.Input((784,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


class EpochTimer:
    """Epoch boundaries in wall time and in this process's CPU time (all its threads)."""

    def __init__(self):
        self.starts, self.ends, self.first_step = [], [], None

    def begin(self):
        self.starts.append((time.perf_counter(), time.process_time()))

    def end(self):
        self.ends.append((time.perf_counter(), time.process_time()))


def lockstep_timer(ls, times: EpochTimer, t_start: float):
    """A lockstep callback that records epoch boundaries and the time to the first step's end."""
    import jax

    class Timer(ls.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times.begin()

        def on_train_batch_end(self, batch_i, logs=None):
            if times.first_step is None:
                jax.block_until_ready(self.trainer.train_state.params)
                times.first_step = time.perf_counter() - t_start

        def on_epoch_end(self, epoch, logs=None):
            times.end()
    return Timer()


def keras_timer(keras, times: EpochTimer, t_start: float):
    """A Keras callback that records epoch boundaries and the time to the first step's end."""
    class KTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times.begin()

        def on_train_batch_end(self, batch_i, logs=None):
            if times.first_step is None:
                times.first_step = time.perf_counter() - t_start

        def on_epoch_end(self, epoch, logs=None):
            times.end()
    return KTimer()


class HandLoop:
    """What a JAX user writes for data parallelism: shard_map over the devices, a psum of the
    gradients, optax; batches indexed and placed from the host, one step a call, at most 8 steps
    in flight (DESIGN.md)."""

    #: the parts of a step that `epoch` times when asked
    DATA, CALL, WAIT = ("data (index, copy, device_put)", "the call: dispatch, the device's work run inline",
                        "waiting for the device")

    def __init__(self, model: str, devices: int, x, y, batch: int):
        import jax
        import jax.numpy as jnp
        import optax
        from jax.sharding import NamedSharding, PartitionSpec as P

        km = keras_model(model)
        mesh = jax.make_mesh((devices,), ("batch",), devices=jax.devices()[:devices],
                             axis_types=(jax.sharding.AxisType.Auto,))
        rep, self.split = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
        self.tv = jax.device_put([v.value for v in km.trainable_variables], rep)
        self.ntv = jax.device_put([v.value for v in km.non_trainable_variables], rep)
        tx = optax.adam(1e-3, eps=1e-7)
        self.opt = jax.device_put(tx.init(self.tv), rep)

        def local_step(tv, ntv, opt, xb, yb):
            global_rows = xb.shape[0] * devices

            def loss_fn(tv):
                logits, _ = km.stateless_call(tv, ntv, xb, training=True)
                return optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum() / global_rows, logits
            # gradients of the replicated parameters come back summed over devices: the global mean
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv)
            updates, opt = tx.update(grads, opt, tv)
            correct = jax.lax.psum(jnp.sum(logits.argmax(-1) == yb), "batch")
            return optax.apply_updates(tv, updates), opt, jax.lax.psum(loss, "batch"), correct

        self.step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P(), P("batch"), P("batch")),
                                          out_specs=(P(), P(), P(), P())))
        self.x, self.y, self.batch, self.devices = x, y, batch, devices

    def epoch(self, seed: int, parts: dict | None = None, first_step=None) -> None:
        """One epoch in the order drawn from `seed`; `parts` (a dict) adds each part's seconds;
        `first_step()` is called once the first step has finished."""
        import jax
        import numpy as np

        order = np.random.default_rng([0, seed]).permutation(len(self.x))
        in_flight, correct = deque(), []
        clock = time.perf_counter
        for lo in range(0, len(self.x), self.batch):
            t = clock()
            idx = order[lo:lo + self.batch]
            if len(idx) % self.devices:  # the short last batch: keep a multiple of the device count
                idx = idx[: len(idx) - len(idx) % self.devices]
            xb, yb = jax.device_put((self.x[idx], self.y[idx]), self.split)
            t1 = clock()
            self.tv, self.opt, loss, c = self.step(self.tv, self.ntv, self.opt, xb, yb)
            correct.append(c)
            if first_step is not None:
                jax.block_until_ready(self.tv)
                first_step()
                first_step = None
            in_flight.append(loss)
            t2 = clock()
            if len(in_flight) > 8:
                in_flight.popleft().block_until_ready()
            if parts is not None:
                parts[self.DATA] += t1 - t
                parts[self.CALL] += t2 - t1
                parts[self.WAIT] += clock() - t2
        int(sum(int(v) for v in correct))


def child_fit(system: str, model: str, devices: int, n: int, epochs: int, batch: int) -> dict:
    t_start = time.perf_counter()
    if system == "tf":
        return child_tf(model, devices, n, epochs, batch, t_start)
    os.environ["KERAS_BACKEND"] = "jax"
    import lockstep as ls

    ls.simulate_cpu_devices(devices)
    import jax
    import numpy as np

    x, y = make_data(n, model)
    times = EpochTimer()
    if system in ("lockstep", "lockstep_per_replica"):
        strategy = ls.MirroredStrategy(devices)

        with strategy.scope():
            km = keras_model(model)
        trainer = ls.Trainer(km, optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                             metrics=["accuracy"],
                             batch_statistics="per_replica" if system == "lockstep_per_replica" else "global")
        assert trainer.strategy.num_replicas_in_sync == devices
        trainer.fit(x, y, batch_size=batch, epochs=epochs, shuffle=True, verbose=0,
                    callbacks=[lockstep_timer(ls, times, t_start)])
    elif system == "jax_loop":
        hand = HandLoop(model, devices, x, y, batch)

        def first_step():
            times.first_step = time.perf_counter() - t_start
        for epoch in range(epochs):
            times.begin()
            hand.epoch(epoch, first_step=first_step if times.first_step is None else None)
            times.end()
    elif system == "keras":
        import keras

        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:devices]))
        km = keras_model(model)
        km.compile(optimizer=keras.optimizers.Adam(1e-3),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

        usable = n - n % devices
        km.fit(x[:usable], y[:usable], batch_size=batch, epochs=epochs, shuffle=True, verbose=0,
               callbacks=[keras_timer(keras, times, t_start)])
    return summary(times, n)


def summary(times: EpochTimer, n: int) -> dict:
    """Samples/s of the median epoch after the first (which compiles), start-up time, peak memory.

    Also the median CPU seconds per epoch: the work done, which a shared machine's slow spells
    (other tenants, stolen cycles) disturb less than wall time.
    """
    walls = [e[0] - s[0] for s, e in zip(times.starts[1:], times.ends[1:])]
    cpus = [e[1] - s[1] for s, e in zip(times.starts[1:], times.ends[1:])]
    return {"samples_per_s": n / statistics.median(walls), "cpu_s_per_epoch": statistics.median(cpus),
            "startup_s": times.first_step, "peak_mb": peak_mb(), "epochs_timed": len(walls)}


def child_tf(model, devices, n, epochs, batch, t_start):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf  # noqa: F401  (optional: only when installed)

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * devices)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(devices)])
    x, y = make_data(n, model)
    times = EpochTimer()

    with strategy.scope():
        km = keras_model(model)
        km.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy"])
    km.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[keras_timer(keras, times, t_start)])
    return summary(times, n)


def child_eval(devices: int, n: int, batch: int, repeats: int) -> dict:
    """Exact (masked) evaluation against the same compiled evaluation without masks."""
    os.environ["KERAS_BACKEND"] = "jax"
    import lockstep as ls

    ls.simulate_cpu_devices(devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    x, y = make_data(n, "mlp")
    strategy = ls.MirroredStrategy(devices)
    km = keras_model("mlp")
    trainer = ls.Trainer(km, loss="sparse_categorical_crossentropy_from_logits", metrics=["accuracy"],
                         strategy=strategy)
    trainer.evaluate(x[:batch], y[:batch], batch_size=batch)
    params = trainer.train_state.params

    def step(params, state, batch_, masked):
        xb, yb = batch_
        logits = km.stateless_call(params["trainable"], params["non_trainable"], xb)[0]
        loss = ls.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True)
        hit = (logits.argmax(-1) == yb).astype(jnp.float32)
        w = ls.get_replica_context().mask if masked else jnp.ones_like(loss)
        return {"loss": state["loss"] + jnp.sum(jnp.where(w > 0, loss, 0.0)), "count": state["count"] + jnp.sum(w),
                "correct": state["correct"] + jnp.sum(w * hit)}

    def loop(masked):
        state = strategy.experimental_distribute_values_from_function(
            lambda ctx: {"loss": np.float32(0), "count": np.float32(0), "correct": np.float32(0)})
        # without masks the short last batch cannot be split exactly, so it is dropped (less work)
        usable = n if masked else n - n % batch
        for batch_ in strategy.experimental_distribute_dataset(ls.data.batches((x[:usable], y[:usable]), batch)):
            state = strategy.run(step, args=(params, state, batch_, masked))
        return {k: float(strategy.reduce("SUM", v)) for k, v in state.items()}

    import statistics

    out = {}
    for name, fn in (("unmasked", lambda: loop(False)), ("masked", lambda: loop(True)),
                     ("trainer_evaluate", lambda: trainer.evaluate(x, y, batch_size=batch))):
        fn()
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        out[name] = statistics.median(runs)
    return out


def child_metrics(devices: int, repeats: int) -> dict:
    """Reading 10 metrics' per-replica state: one reduction for all against one per metric."""
    import lockstep as ls

    ls.simulate_cpu_devices(devices)
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, size=4096)
    p = rng.dirichlet(np.ones(10), size=4096).astype(np.float32)
    onehot = np.eye(10, dtype=np.float32)[y]
    m = ls.metrics
    metrics = [m.CategoricalAccuracy(), m.TopKCategoricalAccuracy(k=3), m.Precision(), m.Recall(),
               m.F1Score(average="macro"), m.F1Score(average="micro", name="f1_micro"), m.AUC(),
               m.AUC(curve="PR", name="pr_auc"), m.MeanSquaredError(), m.MeanAbsoluteError()]
    c = m.MetricCollection(metrics)
    c.build(onehot.shape, p.shape)
    s = ls.MirroredStrategy(devices)
    state = c.init()
    for batch in s.experimental_distribute_dataset(ls.data.batches((onehot, p), 512)):
        state = s.run(lambda st, b: c.update(st, b[0], b[1]), args=(state, batch))

    def together():
        return {k: float(np.asarray(v).ravel()[0]) for k, v in c.compute(state).items()}

    def one_by_one():
        return {k: float(np.asarray(mm.compute(state[k])).ravel()[0]) for k, mm in c.metrics.items()}

    out = {}
    for name, fn in (("one_by_one", one_by_one), ("together", together)):
        fn()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t) / repeats
    return out


def run_child(args: list[str], timeout: int = 1800) -> dict | str:
    return run_script(__file__, args, timeout=timeout)


def run_script(script: str, args: list[str], env: dict | None = None, timeout: int = 1800) -> dict | str:
    """`script --child *args` in a fresh process (`env` added to this one's, without XLA_FLAGS): the
    JSON its last line prints, or why it failed."""
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "", **(env or {})}
    proc = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed: {tail[0][:160]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_report(path: str, lines: list[str]) -> None:
    """Writes a benchmark's Markdown report (its lines) to `path` and says so."""
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, JAX {jax.__version__}, "
            f"{platform.system()} {platform.release()}")


def bn_section(args, n: int, epochs: int, batch: int) -> list[str]:
    """A CNN with BatchNorm: exact (global-batch) statistics against per-replica statistics and
    against Keras 3 DataParallel, in interleaved rounds; the ratio is taken within each round."""
    runs: dict = {}
    for devices in [int(d) for d in args.devices.split(",")]:
        for rnd in range(args.rounds):
            for system in BN_SYSTEMS[rnd % 3:] + BN_SYSTEMS[:rnd % 3]:
                r = run_child(["fit", system, "cnn_bn", str(devices), str(n), str(epochs), str(batch)])
                runs.setdefault((devices, system), []).append(r)
                print("cnn_bn", devices, system, f"round {rnd + 1}", r, flush=True)
    lines = ["", f"## BatchNorm: a CNN with 2 BatchNormalization layers, {n} samples, global batch {batch}, "
             f"{epochs} epochs; {args.rounds} interleaved rounds, medians", "",
             "| devices | system | samples/s | time ratio to per-replica statistics (range) | CPU-time ratio |",
             "|---|---|---|---|---|"]
    for (devices, system), rs in runs.items():
        refs = runs[(devices, "lockstep_per_replica")]
        pairs = [(r, ref) for r, ref in zip(rs, refs) if isinstance(r, dict) and isinstance(ref, dict)]
        if not pairs:
            lines.append(f"| {devices} | {LABELS[system]} | {rs[0]} | | |")
            continue
        slow = [ref["samples_per_s"] / r["samples_per_s"] for r, ref in pairs]  # > 1: slower than per-replica
        cpu = [r["cpu_s_per_epoch"] / ref["cpu_s_per_epoch"] for r, ref in pairs]
        lines.append(f"| {devices} | {LABELS[system]} | {statistics.median(r['samples_per_s'] for r, _ in pairs):,.0f} | "
                     f"{statistics.median(slow):.2f} ({min(slow):.2f}-{max(slow):.2f}) | {statistics.median(cpu):.2f} |")
    lines += ["", "Time ratio: the epoch's wall time over that of per-replica statistics in the same round "
              "(1.10 = 10% slower). Exact statistics add two small all-reduces per BatchNorm layer. Keras' "
              "DataParallel also normalises over the global batch on JAX, but drops the samples that do not "
              "divide over the devices."]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer samples and epochs (a smoke run)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--devices", default="1,4")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the fit rows (default 5)")
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "fit":
            system, model, devices, n, epochs, batch = rest
            result = child_fit(system, model, int(devices), int(n), int(epochs), int(batch))
        elif kind == "eval":
            result = child_eval(int(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]))
        else:
            result = child_metrics(int(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return 0

    n = 4000 if args.quick else 20000
    model_epochs = {"mlp": 2 if args.quick else 12, "cnn": 2 if args.quick else 3}
    batch = 256
    try:
        import importlib.util
        have_tf = importlib.util.find_spec("tensorflow") is not None
    except ValueError:
        have_tf = False
    lines = ["# Benchmarks", "", f"Machine: {machine()}.", "",
             f"Command: `make bench` (`python benchmarks/bench.py{' --quick' if args.quick else ''}`); every row ran in "
             "its own child process of one run, on simulated CPU devices that share the machine's cores "
             "(so more devices is slower here: compare systems within one device count).", ""]
    results: dict = {}
    for model in filter(None, args.models.split(",")):
        for devices in [int(d) for d in args.devices.split(",")]:
            # rounds interleave the systems, so a slow spell of a shared machine hits them alike;
            # each ratio to (b) is taken within one round, then the median over rounds is reported
            for rnd in range(args.rounds):
                for system in SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)]:  # rotated order
                    runs = results.setdefault((model, devices, system), [])
                    if system == "tf" and not have_tf:
                        if not runs:
                            runs.append("not run: TensorFlow is not installed (optional extra)")
                        continue
                    r = run_child(["fit", system, model, str(devices), str(n), str(model_epochs[model]), str(batch)])
                    runs.append(r)
                    print(model, devices, system, f"round {rnd + 1}", r, flush=True)
    lines += [f"## fit: {n} samples, global batch {batch}; {model_epochs['mlp']} epochs (MLP) and "
              f"{model_epochs['cnn']} (CNN); samples/s of the median epoch after the first; "
              f"{args.rounds} interleaved rounds, medians", "",
              "| model | devices | system | samples/s | ratio to (b) (range over rounds) | CPU-time ratio to (b) "
              "| start-up to first step (s) | peak memory (MB) |",
              "|---|---|---|---|---|---|---|---|"]
    for (model, devices, system), runs in results.items():
        refs = results.get((model, devices, "jax_loop"), [])
        ok = [r for r in runs if isinstance(r, dict)]
        if not ok:
            lines.append(f"| {model} | {devices} | {LABELS[system]} | {runs[0] if runs else 'not run'} | | | | |")
            continue
        pairs = [(r, ref) for r, ref in zip(runs, refs) if isinstance(r, dict) and isinstance(ref, dict)]
        ratios = [r["samples_per_s"] / ref["samples_per_s"] for r, ref in pairs]
        ratio = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        # > 1 means less CPU time per epoch than (b): the work done, steadier than wall time here
        cpu = [ref["cpu_s_per_epoch"] / r["cpu_s_per_epoch"] for r, ref in pairs]
        cpu_ratio = f"{statistics.median(cpu):.2f}" if cpu else "-"
        failed = len(runs) - len(ok)
        lines.append(f"| {model} | {devices} | {LABELS[system]} | "
                     f"{statistics.median(r['samples_per_s'] for r in ok):,.0f}{f' ({failed} failed)' if failed else ''} | "
                     f"{ratio} | {cpu_ratio} | {statistics.median(r['startup_s'] for r in ok):.2f} | "
                     f"{statistics.median(r['peak_mb'] for r in ok):,.0f} |")
    lines += ["", "CPU-time ratio: (b)'s CPU seconds per epoch (all threads of the process) over the system's; "
              "above 1 means less work than (b). It is steadier than wall time on a shared machine."]
    lines += bn_section(args, n, model_epochs["cnn"], batch)
    lines += ["", "## exact evaluation: masks against no masks", "",
              "| devices | samples | batch | unmasked (s) | masked, exact (s) | ratio | Trainer.evaluate (s) |",
              "|---|---|---|---|---|---|---|"]
    for devices in [int(d) for d in args.devices.split(",")]:
        r = run_child(["eval", str(devices), str(n + 13), str(batch), "7"])
        print("eval", devices, r, flush=True)
        if isinstance(r, dict):
            lines.append(f"| {devices} | {n + 13} | {batch} | {r['unmasked']:.4f} | {r['masked']:.4f} | "
                         f"{r['masked'] / r['unmasked']:.2f} | {r['trainer_evaluate']:.4f} |")
    lines += ["", "Both loops are the same compiled evaluation step over the same batches; the exact one "
              "applies the padding mask and also evaluates the short last batch (13 samples), which the "
              "unmasked one must drop. Times are the median of 7 runs.", "",
              "## reading 10 metrics", "", "| devices | one by one (ms) | one reduction for all (ms) | speed-up |",
              "|---|---|---|---|"]
    for devices in [int(d) for d in args.devices.split(",")]:
        r = run_child(["metrics", str(devices), "20"])
        print("metrics", devices, r, flush=True)
        if isinstance(r, dict):
            lines.append(f"| {devices} | {1000 * r['one_by_one']:.2f} | {1000 * r['together']:.2f} | "
                         f"{r['one_by_one'] / r['together']:.1f}x |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
