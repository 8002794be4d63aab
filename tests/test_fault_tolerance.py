"""BackupAndRestore, preemption and restarts: resumed runs equal uninterrupted ones, bit for bit."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import lockstep as ls

import common  # noqa: E402
from launching import (  # noqa: E402
    CHILD_XLA_FLAGS,
    launch_env,
    launch_workers,
    output_of,
    resume_command,
    resume_result,
    run_resume_job,
)
from suite import variants  # noqa: E402

# these tests start processes: with `make test`'s two pytest workers, they run one after another
pytestmark = pytest.mark.xdist_group("processes")


@pytest.mark.full_suite  # make test: restarts in the worker matrix, the elastic resume and SIGTERM tests
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_killed_mid_epoch_and_restarted_equals_an_uninterrupted_run(nproc, tmp_path, uninterrupted):
    proc = run_resume_job(nproc, tmp_path, "kill")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"rank {nproc - 1} killed by SIGKILL" in proc.stderr
    assert "restarting the workers (restart 1 of 1)" in proc.stderr
    weights, hist = resume_result(tmp_path)
    ref_weights, ref_hist = uninterrupted[nproc]
    assert hist["restored_from"] == 40  # killed at step 42; the last backup (every 5 steps) was at 40
    np.testing.assert_array_equal(weights, ref_weights)  # bitwise on CPU: same programs, same data order
    assert hist["history"] == ref_hist["history"] and hist["epoch"] == ref_hist["epoch"]
    assert not any((tmp_path / "backup").glob("*")), "backups are deleted once fit succeeds"


def test_sigterm_makes_every_worker_save_at_the_same_step_exit_83_and_resume_exactly(tmp_path, uninterrupted):
    launcher = subprocess.Popen(resume_command(2, tmp_path, "term"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=launch_env())
    lines = []
    try:
        victim = None
        while True:
            line = launcher.stdout.readline()
            assert line, "the job ended before it could be preempted"
            lines.append(line)
            if line.startswith("[rank 1] pid") and victim is None:
                victim = int(line.split()[3])
            if line.startswith("[rank 1] step 12"):
                os.kill(victim, signal.SIGTERM)  # preempt one worker only
                break
        rest, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    out = "".join(lines) + rest
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    saved = [line for line in out.splitlines() if "preempted: backup saved at step" in line]
    assert len(saved) == 2 and len({line.split("step ")[1] for line in saved}) == 1, \
        (saved, out[-3000:], err[-3000:])  # the same step
    assert "rank 1 exited with code 83 (preempted; backup saved)" in err or \
        "rank 0 exited with code 83 (preempted; backup saved)" in err
    weights, hist = resume_result(tmp_path)
    ref_weights, ref_hist = uninterrupted[2]
    np.testing.assert_array_equal(weights, ref_weights)
    assert hist["history"] == ref_hist["history"]


@pytest.mark.full_suite  # make test: Keras EarlyStopping through a backup in test_keras_as_written, one process
def test_early_stopping_across_a_restart_stops_at_the_same_epoch(tmp_path):
    proc = run_resume_job(1, tmp_path, "es")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restarting the workers" in proc.stderr
    weights, hist = resume_result(tmp_path)
    # the same run in this process, never interrupted
    parts = common.validation_parts(2)
    vx, vy = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    x, y = common.data()
    t = common.trainer(ls.MirroredStrategy(1))
    ref = t.fit(x, y, batch_size=64, epochs=12, seed=3, verbose=0, validation_data=(vx, vy),
                callbacks=[ls.callbacks.EarlyStopping(**common.ES, restore_best_weights=True)])
    assert hist["epoch"] == ref.epoch and len(ref.epoch) < 12  # it did stop early
    np.testing.assert_allclose(weights, common.flat(t.get_weights()),
                               rtol=1e-5, atol=1e-6)


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from lockstep.checkpoint import TrainingCheckpointer
    store = TrainingCheckpointer(sys.argv[1], async_save=sys.argv[2] == "async")
    step = (store.latest_step() or 0) + 1
    big = np.zeros((512, 512), np.float32)
    first = step
    while True:
        big[:] = step
        store.save(step, {"a": big, "b": np.full(9, step, np.int64)}, {"step": step})
        if step == first:
            store.wait()  # the first save written (in the background too) before the kill may come: progress per trial
        print("saved", step, flush=True)
        step += 1
""")


#: kills per run of the checkpoint stress test: a few in `make test`, 20 in `make test-full`
KILLS = int(os.environ.get("LOCKSTEP_FAULT_TRIALS", "6"))


@pytest.mark.parametrize("mode", variants(["sync", "async"], {"async"}))  # async (default): killed while a background write goes on
def test_killing_the_saving_process_repeatedly_never_leaves_a_partial_checkpoint(tmp_path, mode):
    rng = np.random.default_rng(0)
    directory = tmp_path / "ckpt"
    seen = []
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS}
    for trial in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), mode], stdout=subprocess.PIPE, text=True,
                                env=env)
        try:
            assert proc.stdout.readline().startswith("saved")
            time.sleep(rng.uniform(0.0, 0.25))  # somewhere inside a later save
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
        store = ls.checkpoint.TrainingCheckpointer(directory)
        step = store.latest_step()
        for listed in store.all_steps():  # every checkpoint it lists is whole, the newest included
            arrays, meta = store.restore(listed)
            assert meta["step"] == listed
            assert np.all(arrays["a"] == listed) and np.all(arrays["b"] == listed)  # never a mix
        store.close()
        seen.append(step)
    assert seen == sorted(seen) and seen[-1] >= KILLS  # progress across kills


class _TermAt(ls.callbacks.Callback):
    """Sends SIGTERM to this process as global step `at` begins."""

    def __init__(self, at):
        super().__init__()
        self.at, self.count = at, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.count += 1
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("at", variants([13, 15], {15}))  # 15 is also a periodic backup step: that backup is not written twice
def test_preemption_in_one_process_saves_once_exits_83_and_resumes_exactly(tmp_path, at):
    x, y = common.data()
    kwargs = dict(batch_size=64, epochs=2, seed=3, verbose=0)
    ref = common.trainer(ls.MirroredStrategy(1))
    ref_hist = ref.fit(x, y, **kwargs)

    t = common.trainer(ls.MirroredStrategy(1))
    backup = ls.callbacks.BackupAndRestore(tmp_path, save_freq=5, delete_checkpoint=False)
    with pytest.raises(SystemExit) as exc:
        t.fit(x, y, callbacks=[backup, _TermAt(at)], **kwargs)
    assert exc.value.code == ls.callbacks.PREEMPTED_EXIT_CODE
    store = ls.checkpoint.TrainingCheckpointer(tmp_path)
    assert store.latest_step() == at
    store.close()

    t = common.trainer(ls.MirroredStrategy(1))
    backup = ls.callbacks.BackupAndRestore(tmp_path, save_freq=5)
    hist = t.fit(x, y, callbacks=[backup], **kwargs)
    assert backup.restored_from == at
    for a, b in zip(jax.tree.leaves(t.get_weights()), jax.tree.leaves(ref.get_weights())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hist.history == ref_hist.history



@pytest.mark.parametrize("damage, k", [
    pytest.param(False, 1, marks=pytest.mark.full_suite),  # make test: such backups in the worker matrix,
    pytest.param(True, 1, marks=pytest.mark.full_suite),   # damaged ones in test_state_trust
    (False, 4)])
def test_backups_and_kills_at_steps_where_a_worker_holds_no_row_resume_exactly(damage, k, tmp_path):
    """Digits on 2 workers, batch 64: the 5-row last batch of each epoch is all worker 0's. Killed
    after step 58, such a step and a backup step (before the fix, worker 1 crashed in that backup),
    and restarted, the run ends as the uninterrupted one (one step a call, one process). With
    `damage`, the killed worker first flipped bits in that backup's files: both workers set it aside
    and resume from step 56. With k = 4 steps a call, step 58 ends a call."""
    import zero_rows_job

    proc = launch_workers(zero_rows_job.__file__, tmp_path, *["damage"] * damage, f"k={k}", failure_timeout=10,
                          max_restarts=1)
    assert proc.returncode == 0, output_of(proc)
    assert "rank 1 killed by SIGKILL" in proc.stderr and "restart 1 of 1" in proc.stderr
    weights, hist = resume_result(tmp_path)
    ref, ref_hist = zero_rows_job.run(ls.MirroredStrategy(2))  # one process, the same 2 replicas, uninterrupted
    assert hist["restored_from"] == (56 if damage else 58)
    if damage:
        output = proc.stdout + proc.stderr
        assert output.count("the backup of step 58 is damaged") == 2, output[-3000:]  # both workers name it
        assert (tmp_path / "backup" / "damaged" / "58").is_dir()
    assert np.max(np.abs(weights - common.flat(ref.get_weights()))) <= 1e-6
    np.testing.assert_allclose([v for k in sorted(hist["history"]) for v in hist["history"][k]],
                               [v for k in sorted(ref_hist.history) for v in ref_hist.history[k]], rtol=1e-6)
