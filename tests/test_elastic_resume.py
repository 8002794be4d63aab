"""Backups resume on another number of replicas and workers (same global batch): the same data
order and metric state, the weights placed on the new devices."""

import jax
import numpy as np
import optax
import pytest

import lockstep as ls
from launching import StopAt, Stopped, resume_result, run_resume_job
from suite import variants

N, B, EPOCHS = 403, 32, 2
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 6)).astype(np.float32)
Y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(np.int32) + (X[:, 2] > 1).astype(np.int32)


def trainer(replicas):
    model = ls.FunctionalModel(
        lambda key, x: {"w": jax.random.normal(key, (6, 3)) * 0.3, "b": np.zeros(3, np.float32)},
        lambda p, x, training=False: x @ p["w"] + p["b"])
    return ls.Trainer(model, optimizer=optax.adam(0.02), loss="sparse_categorical_crossentropy_from_logits",
                      metrics=["accuracy", ls.metrics.F1Score(average="macro", num_classes=3)],
                      strategy=ls.MirroredStrategy(replicas))


def fit(t, backup=None, stop=None, batch_size=B):
    callbacks = [] if backup is None else [ls.callbacks.BackupAndRestore(backup, save_freq=3)]
    callbacks += [] if stop is None else [StopAt(stop)]
    return t.fit(X, Y, batch_size=batch_size, epochs=EPOCHS, seed=5, verbose=0, callbacks=callbacks).history


@pytest.mark.parametrize("before, after", variants([(4, 2), (2, 4), (3, 8), (8, 1)], {(3, 8)}))
def test_a_backup_taken_on_r_replicas_resumes_on_another_number(before, after, tmp_path):
    want_t = trainer(after)
    want = fit(want_t)
    with pytest.raises(Stopped):
        fit(trainer(before), tmp_path, stop=20)  # 13 steps an epoch: stopped in epoch 2, last backup at 18
    resumed = trainer(after)
    got = fit(resumed, tmp_path)
    assert resumed.strategy.num_replicas_in_sync == after
    for a, b in zip(jax.tree.leaves(resumed.get_weights()), jax.tree.leaves(want_t.get_weights())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert sorted(got) == sorted(want)
    for k in want:  # the epoch-2 logs hold 5 steps run on `before` replicas and 8 on `after`
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_the_metric_state_is_kept_per_replica_and_counts_every_sample_once():
    """On the same number of replicas a backup restores bit for bit; on another, its entries are
    reduced first (the elastic tests above); either way it counts every sample once."""
    t = trainer(4)
    seen = {}

    class Look(ls.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.global_step == 5:
                counts = np.asarray(self.model.train_state.metric_state["loss"]["count"])
                seen["shape"], seen["count"] = counts.shape, float(counts.sum())

    t.fit(X, Y, batch_size=B, epochs=1, verbose=0, callbacks=[Look()])
    assert seen == {"shape": (4,), "count": 5 * B}


def test_a_changed_global_batch_on_resume_is_refused(tmp_path):
    with pytest.raises(Stopped):
        fit(trainer(4), tmp_path, stop=5)
    with pytest.raises(ValueError, match=r"global batch size 32, and this fit uses 64.*Resume with global batch size 32"):
        fit(trainer(4), tmp_path, batch_size=64)
    t = ls.Trainer(trainer(4).model, optimizer=optax.adam(0.02), loss="sparse_categorical_crossentropy_from_logits",
                   strategy=ls.MirroredStrategy(4), gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps 1, and this fit uses 2"), \
            pytest.warns(UserWarning, match=r"\['accuracy', 'f1_score'\] no longer compiled"):
        t.fit(X, Y, batch_size=B, epochs=EPOCHS, seed=5, verbose=0,
              callbacks=[ls.callbacks.BackupAndRestore(tmp_path, save_freq=3)])




@pytest.mark.xdist_group("processes")
@pytest.mark.parametrize("before, after", [(2, 1), pytest.param(1, 2, marks=pytest.mark.full_suite)])
def test_a_job_killed_on_w_workers_resumes_on_another_number(before, after, tmp_path, uninterrupted):
    killed = run_resume_job(before, tmp_path, "kill", restarts=0)
    assert killed.returncode != 0 and f"rank {before - 1} killed by SIGKILL" in killed.stderr, killed.stderr[-2000:]
    resumed = run_resume_job(after, tmp_path, "plain", restarts=0)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    weights, hist = resume_result(tmp_path)
    ref_weights, ref_hist = uninterrupted[after]
    assert hist["restored_from"] == 40  # killed at step 42 on `before` workers; the backup of step 40
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-5, atol=1e-6)
    assert hist["epoch"] == ref_hist["epoch"]
    for k, v in ref_hist["history"].items():
        np.testing.assert_allclose(hist["history"][k], v, rtol=1e-5, atol=1e-6)
