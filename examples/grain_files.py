"""Training from a Grain pipeline over files on disk: 2 workers, one killed, resumed on 1.

The data are scikit-learn's handwritten digits, written by this script as 4 `.npy` shards. A
small Grain data source reads one sample from a shard (memory-mapped) per `__getitem__`; a
`grain.MapDataset` scales it. `Trainer.fit` batches globally (64 samples a step, order from the
seed and the epoch), and each worker reads only the samples of its own replicas.

The script plays the cluster, as a user would run it:

1. `lockstep launch --nproc-per-node 2` trains with `BackupAndRestore` (every 5 steps); worker 1
   is killed at step 32, in the second epoch (no restarts), so the job fails;
2. `lockstep launch --nproc-per-node 1` runs the same script: it resumes from the last backup
   (step 30, taken by 2 workers) on 1 worker and finishes;
3. this process trains uninterrupted on one device, and the weights and history of the resumed
   run are compared with it.

    python examples/grain_files.py
"""

import json
import os
import signal
import subprocess
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

BATCH, EPOCHS, SHARDS = 64, 3, 4


def write_shards(data_dir: str) -> None:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    for k, (xs, ys) in enumerate(zip(np.array_split(x.astype(np.float32), SHARDS),
                                     np.array_split(y.astype(np.int32), SHARDS))):
        np.save(os.path.join(data_dir, f"x{k}.npy"), xs)
        np.save(os.path.join(data_dir, f"y{k}.npy"), ys)


class NpyShards:
    """A Grain-style data source: sample `i` read from its shard on disk (memory-mapped)."""

    def __init__(self, data_dir: str):
        self._x = [np.load(os.path.join(data_dir, f"x{k}.npy"), mmap_mode="r") for k in range(SHARDS)]
        self._y = [np.load(os.path.join(data_dir, f"y{k}.npy"), mmap_mode="r") for k in range(SHARDS)]
        self._starts = np.cumsum([0] + [len(a) for a in self._x])
        self.reads: list[int] = []

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int):
        self.reads.append(int(i))
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        return np.array(self._x[k][i - self._starts[k]]), np.array(self._y[k][i - self._starts[k]])


def pipeline(data_dir: str):
    import grain

    source = NpyShards(data_dir)
    return source, grain.MapDataset.source(source).map(lambda s: (s[0] / 16.0, s[1]))  # pixels 0..16 -> 0..1


def train(strategy, dataset, callbacks=()):
    import keras

    import lockstep as ls

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    trainer = ls.Trainer(model)
    history = trainer.fit(dataset, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0, callbacks=list(callbacks))
    return trainer, history.history


def worker(data_dir: str, out_dir: str) -> None:
    import lockstep as ls

    strategy = ls.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id

    class KillAt(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if strategy.num_workers == 2 and rank == 1 and self.model.global_step == 32:
                os.kill(os.getpid(), signal.SIGKILL)  # a lost machine

    source, dataset = pipeline(data_dir)
    backup = ls.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=5)
    trainer, history = train(strategy, dataset, [backup, KillAt()])
    if rank == 0:
        np.savez(os.path.join(out_dir, "resumed.npz"), *trainer.get_weights())
        with open(os.path.join(out_dir, "resumed.json"), "w") as f:
            json.dump({"history": {k: [float(v) for v in vs] for k, vs in history.items()},
                       "restored_from": backup.restored_from, "workers": strategy.num_workers}, f)


def launch(workers: int, out_dir: str, data_dir: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", str(workers), "--failure-timeout", "10",
           __file__, "worker", data_dir, out_dir]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "XLA_FLAGS": ""})


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, out_dir = os.path.join(tmp, "data"), os.path.join(tmp, "out")
        os.makedirs(data_dir)
        os.makedirs(out_dir)
        write_shards(data_dir)
        first = launch(2, out_dir, data_dir)
        print("2 workers:", (first.stderr.strip().splitlines() or ["?"])[-1])
        second = launch(1, out_dir, data_dir)
        print("1 worker: ", "finished" if second.returncode == 0 else second.stderr[-2000:])
        if second.returncode != 0:
            return 1
        resumed = np.load(os.path.join(out_dir, "resumed.npz"))
        with open(os.path.join(out_dir, "resumed.json")) as f:
            info = json.load(f)

        import lockstep as ls

        _, dataset = pipeline(data_dir)
        reference, history = train(ls.MirroredStrategy(1), dataset)
        worst = max(float(np.max(np.abs(resumed[f"arr_{k}"] - w))) for k, w in enumerate(reference.get_weights()))
        gaps = [abs(a - b) for k in history for a, b in zip(info["history"][k], history[k])]
        checks = {
            "job of 2 workers failed (worker 1 killed)": first.returncode != 0 and "rank 1" in first.stderr,
            f"resumed on {info['workers']} worker from step {info['restored_from']}":
                info["workers"] == 1 and info["restored_from"] == 30,
            f"weights vs one device (largest difference {worst:.1e})": worst <= 1e-5,
            f"history vs one device (largest difference {max(gaps):.1e})": max(gaps) <= 1e-5,
        }
        for name, ok in checks.items():
            print(f"  {name:<58} {'agree' if ok else 'DISAGREE'}")
        agree = all(checks.values())
        print("the resumed run and one device agree" if agree else "RESUMED RUN AND ONE DEVICE DISAGREE")
        return 0 if agree else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(main())
