"""A stacked LSTM on variable-length time series, on two worker processes configured by TF_CONFIG.

The model of the seed article's second example (Masking, two LSTMs, BatchNormalization, a
dense head), trained with `MultiWorkerMirroredStrategy` exactly as the `tf.distribute`
multi-worker tutorial writes it: each worker reads its role from `TF_CONFIG`. Run without
`TF_CONFIG`, this script plays the cluster: it starts two workers on 127.0.0.1 (bounded in
time, always reaped), then trains the same model in this one process on one device and checks
that both workers ended with those weights and those losses.

    python examples/lstm_multi_worker.py
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

N, LENGTH, BATCH, EPOCHS = 203, 20, 32, 3  # the last batch of 11 rows: uneven over workers
WORKER_TIMEOUT = 240


def series(n: int = N, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Noisy sine waves of 5 to 20 steps, zero-padded to 20; the target is the next value."""
    rng = np.random.default_rng(seed)
    freq, phase = rng.uniform(0.2, 0.8, n), rng.uniform(0, 2 * np.pi, n)
    lengths = rng.integers(5, LENGTH + 1, n)
    t = np.arange(LENGTH + 1)[None, :]
    wave = np.sin(freq[:, None] * t + phase[:, None]) + 1.5 + 0.05 * rng.normal(size=(n, LENGTH + 1))
    x = np.where(t[:, :LENGTH] < lengths[:, None], wave[:, :LENGTH], 0.0)[..., None].astype(np.float32)
    y = wave[np.arange(n), lengths].astype(np.float32)[:, None]
    return x, y


def train(strategy) -> tuple[list[np.ndarray], list[float]]:
    """The tutorial's code as written: build and compile in the strategy's scope, then `model.fit`."""
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((None, 1)),
            keras.layers.Masking(mask_value=0.0),
            keras.layers.LSTM(32, return_sequences=True),
            keras.layers.LSTM(16),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = series()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)  # run by lockstep, every sample once
    return model.get_weights(), history.history["loss"]


def worker(out_dir: str) -> None:
    import lockstep as ls

    strategy = ls.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    weights, losses = train(strategy)
    rank = strategy.cluster_resolver.task_id
    np.savez(os.path.join(out_dir, f"worker{rank}.npz"), *weights, losses=np.array(losses),
             replicas=strategy.num_replicas_in_sync)
    print(f"worker {rank}: {strategy.num_replicas_in_sync} replicas, losses {np.round(losses, 4).tolist()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster(out_dir: str, workers: int = 2) -> None:
    """Starts `workers` processes of this script with TF_CONFIG; waits for all, reaps all."""
    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(workers)]
    procs = []
    try:
        for index in range(workers):
            cfg = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
            env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
            env.update(TF_CONFIG=json.dumps(cfg), XLA_FLAGS="", LOCKSTEP_FAILURE_TIMEOUT="30")
            procs.append(subprocess.Popen([sys.executable, __file__, out_dir], env=env, start_new_session=True))
        for p in procs:
            p.wait(timeout=WORKER_TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise SystemExit(f"workers {failed} failed")


def main() -> int:
    with tempfile.TemporaryDirectory() as out_dir:
        cluster(out_dir)
        results = [np.load(os.path.join(out_dir, f"worker{i}.npz")) for i in range(2)]
        import lockstep as ls

        weights, losses = train(ls.MirroredStrategy(1))  # one process, one device
        print(f"one device: losses {np.round(losses, 4).tolist()}")
        agree = True
        for i, res in enumerate(results):
            worst = max(float(np.max(np.abs(res[f"arr_{k}"] - w))) for k, w in enumerate(weights))
            loss_gap = float(np.max(np.abs(res["losses"] - losses) / np.abs(losses)))
            ok = int(res["replicas"]) == 2 and worst <= 1e-5 and loss_gap <= 1e-5
            agree &= ok
            print(f"worker {i}: largest weight difference {worst:.2e}, relative loss difference {loss_gap:.2e}"
                  f"   {'agree' if ok else 'DISAGREE'}")
        print("two workers and one device agree" if agree else "WORKERS AND ONE DEVICE DISAGREE")
        return 0 if agree else 1


if __name__ == "__main__":
    if "TF_CONFIG" in os.environ:
        worker(sys.argv[1])
    else:
        raise SystemExit(main())
