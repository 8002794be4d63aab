"""The worker script of `benchmarks/faults.py`: argv = token, out_dir, scenario, victim rank.

Every worker runs this script under `lockstep launch`. Scenarios:

* collective loop (`kill`, `stop`, `raise`, `exit0`, `slow`): a loop of `strategy.run` steps with
  an all-reduce; at step 20 the victim SIGKILLs itself, SIGSTOPs itself, raises, leaves the loop
  and exits 0, or (`slow`) sleeps 0.6 failure timeouts at three steps and must not be declared dead;
* training (`plain`, `term`, `savekill`): `Trainer.fit` with `BackupAndRestore(save_freq=5)`; the
  victim SIGTERMs itself at step 12 (`term`; `termnobackup`: without the backups, so the job must
  end with code 143), or SIGKILLs itself a random few milliseconds into
  the backup save of step 15 (`savekill`), on the first attempt only;
* `damagekill`: as `plain`, but at step 16 the victim flips a bit in each array file of the
  newest backup (step 15) and SIGKILLs itself: the restart must set that backup aside (a warning on
  every worker) and resume from step 10;
* training with no real row on the victim (`zeroplain`, `zerokill`): 965 samples, batch 64, so each
  epoch's last batch (steps 16 and 32) has 5 rows, all worker 0's; backups every 4 steps; the
  victim SIGKILLs itself at step 16 (`zerokill`), and the restart saves a backup at that step.

Before a fault the victim prints ``FAULT <unix time>``; the harness measures detection from it.
`token` only marks the processes so that the harness can look for orphans.
"""

import json
import os
import pathlib
import random
import signal
import sys
import threading
import time

import lockstep as ls

strategy = ls.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

token, out_dir, scenario, victim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rank = strategy.cluster_resolver.task_id
attempt = int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
is_victim = rank == victim and attempt == 0


def fault_now() -> None:
    print(f"FAULT {time.time():.3f}", flush=True)


def collective_loop() -> None:
    batch = next(iter(strategy.experimental_distribute_dataset([np.ones(12, np.float32)])))  # 2 or 3 divide 12
    total = jnp.zeros(())
    step = lambda t, b: t + ls.get_replica_context().all_reduce("SUM", jnp.sum(b))  # noqa: E731
    for i in range(60):
        total = strategy.run(step, args=(total, batch))
        float(total)  # wait for the collective, as a training loop reading its loss does
        if is_victim and i == 20:
            fault_now()
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif scenario == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif scenario == "raise":
                raise RuntimeError("injected failure in the middle of training")
            elif scenario == "exit0":
                sys.exit(0)
        if scenario == "slow" and rank == victim and i in (10, 20, 30):
            time.sleep(0.6 * strategy.failure_timeout)
        time.sleep(0.02)
    expected = 60 * 12  # the 12 ones of the global batch (no padding row), summed over the replicas, 60 times
    assert float(total) == expected, (float(total), expected)


def data(n: int = 1003) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)
    return x, y


def model() -> ls.FunctionalModel:
    def init(rng, x):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (x.shape[-1], 16)) * 0.3, "b1": jnp.zeros(16),
                "w2": jax.random.normal(k2, (16, 3)) * 0.3, "b2": jnp.zeros(3)}
    return ls.FunctionalModel(init, lambda p, x, training=False: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])


class Chaos(ls.callbacks.Callback):
    """Injects the training faults; placed before `BackupAndRestore` in the callback list."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        if not is_victim:
            return
        if scenario in ("term", "termnobackup") and self.count == 12:
            fault_now()
            os.kill(os.getpid(), signal.SIGTERM)  # the backup at the agreed step, then exit 83 (without one: 143)
        if scenario == "savekill" and self.count == 15:  # BackupAndRestore saves step 15 right after this
            delay = random.uniform(0.0, 0.03)
            threading.Timer(delay, lambda: (fault_now(), os.kill(os.getpid(), signal.SIGKILL))).start()
            time.sleep(0.0)
        if scenario == "damagekill" and self.count == 16:  # the newest backup (step 15) damaged on disk, then dead
            written = pathlib.Path(out_dir, "backup", "15")  # renamed into place once committed (written in the background)
            deadline = time.time() + 60
            while not list(written.glob("arrays/**/d/*")) and time.time() < deadline:
                time.sleep(0.01)
            for f in written.glob("arrays/**/d/*"):
                data = bytearray(f.read_bytes())
                data[len(data) // 2] ^= 0x10
                f.write_bytes(bytes(data))
            fault_now()
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "zerokill" and self.count == 16:  # a step where this worker holds no real row
            fault_now()
            os.kill(os.getpid(), signal.SIGKILL)


def train() -> None:
    zero = scenario.startswith("zero")
    x, y = data(965 if zero else 1003)
    t = ls.Trainer(model(), optimizer="adam", loss="sparse_categorical_crossentropy_from_logits",
                   metrics=["accuracy"], strategy=strategy, seed=0)
    backup = ls.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=4 if zero else 5,
                                           delete_checkpoint=scenario in ("plain", "zeroplain"))
    callbacks = [Chaos()] if scenario == "termnobackup" else [Chaos(), backup]
    hist = t.fit(x, y, batch_size=64, epochs=2, seed=3, verbose=0, callbacks=callbacks)
    if rank == 0:
        flat = np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(t.get_weights())])
        np.save(os.path.join(out_dir, "weights.npy"), flat)
        with open(os.path.join(out_dir, "history.json"), "w") as f:
            json.dump({k: [float(v) for v in vs] for k, vs in hist.history.items()}, f)


if scenario in ("kill", "stop", "raise", "exit0", "slow"):
    collective_loop()
else:
    train()
print(f"worker {rank} done (attempt {attempt})", flush=True)
