"""Several worker processes on 127.0.0.1 (started by `lockstep launch`), checked against one process."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import keras
import numpy as np
import pytest
from sklearn.metrics import accuracy_score, f1_score

import lockstep as ls
from lockstep._exit_codes import LOST_WORKER_EXIT_CODE

import common  # noqa: E402
from common import free_port  # noqa: E402
from launching import CHILD_XLA_FLAGS, WORKERS, launch_workers, rank_results  # noqa: E402

# these tests start processes: with `make test`'s two pytest workers, they run one after another
pytestmark = pytest.mark.xdist_group("processes")

LAUNCH_TIMEOUT = 240


def launch(script, *args, nproc=2, devices=1, failure_timeout=20, env=None, cwd=None):
    """`launch_workers` with this file's defaults: one device per worker, 240 s at most."""
    return launch_workers(script, *args, nproc=nproc, devices=devices, failure_timeout=failure_timeout, env=env,
                          cwd=cwd, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def references():
    """Single-process results of the same job (one replica: the one-device numbers)."""
    s = ls.MirroredStrategy(1)
    x, y = common.data()
    t = common.trainer(s)
    return {"x": x, "y": y, "trainer": t, **common.basic_run(t, x, y)}


#: workers x devices per worker: 3 workers x 2 devices in `make test`; every pair in `make test-full`
# make test: 2 workers x 1 device (CI time; the worker matrix runs 2 x 2); test-full: 3 workers too
SHAPES = [(2, 1)] + [pytest.param(*shape, marks=pytest.mark.full_suite) for shape in [(3, 2), (3, 1), (2, 2)]]


@pytest.mark.parametrize("nproc,devices", SHAPES)
def test_workers_evaluate_predict_fit_and_stop_exactly_like_one_process(nproc, devices, tmp_path, references):
    proc = launch(WORKERS / "trainer_job.py", tmp_path, nproc=nproc, devices=devices)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(nproc)]
    x, y, t = references["x"], references["y"], references["trainer"]
    logits = references["pred"]
    for res in results:
        assert int(res["replicas"]) == nproc * devices
        np.testing.assert_array_equal(res["init"], references["init"])  # same start on every worker
        # evaluate on 1003 samples: exact counts, float32-rounding loss, against scikit-learn
        loss, acc, f1 = res["ev"]
        assert np.float32(acc) == np.float32(accuracy_score(y, logits.argmax(1)))
        np.testing.assert_allclose(f1, f1_score(y, logits.argmax(1), average="macro"), rtol=1e-6)
        np.testing.assert_allclose(loss, references["ev"]["loss"], rtol=1e-6)
        # predict: 1003 rows, in input order, on every worker
        assert res["pred"].shape == (1003, 3)
        np.testing.assert_allclose(res["pred"], logits, rtol=1e-5, atol=1e-6)
        # fit: the single-process weights and losses
        np.testing.assert_allclose(res["fit"], references["fit"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(res["loss"], references["loss"], rtol=1e-5)
    # worker 0 alone read the running loss and metrics as batches began (no callback read their ends)
    assert references["running"].shape == (30, 3)  # 16 batches an epoch, less each epoch's first
    np.testing.assert_allclose(results[0]["running"], references["running"], rtol=1e-5)
    # uneven per-worker pipelines (5 batches on worker 0, 3 on the others): exact over the union
    parts = [common.uneven_batches(w, nproc) for w in range(nproc)]
    ux = np.concatenate([b[0] for p in parts for b in p])
    uy = np.concatenate([b[1] for p in parts for b in p])
    union = t.evaluate(ux, uy, batch_size=len(ux))
    ul = references["trainer"].predict(ux, batch_size=len(ux))
    for res in results:
        loss, acc, f1 = res["uneven"]
        assert np.float32(acc) == np.float32(accuracy_score(uy, ul.argmax(1)))
        np.testing.assert_allclose(f1, f1_score(uy, ul.argmax(1), average="macro"), rtol=1e-6)
        np.testing.assert_allclose(loss, union["loss"], rtol=1e-5)
    # early stopping: every worker stops at the epoch the single process stops at on all the
    # validation data, although the last worker's data alone would have stopped it earlier
    epochs = {tuple(res["es_epochs"]) for res in results}
    assert len(epochs) == 1
    stop_epochs = es_reference_epochs(nproc)
    assert list(epochs.pop()) == stop_epochs["union"]
    # lockstep's ModelCheckpoint (in the background) on every worker: worker 0 wrote each epoch's file
    assert len([f for f in os.listdir(tmp_path) if f.startswith("es-")]) == len(stop_epochs["union"])
    np.testing.assert_array_equal(results[0]["es_written"], results[0]["es_weights"])  # the last epoch's
    assert len(stop_epochs["last_worker_alone"]) < len(stop_epochs["union"])


def test_a_runtime_call_cut_off_by_a_peer_leaving_is_not_named_as_the_cause(tmp_path):
    """Worker 0 names the lost worker 1 and leaves; worker 2's next runtime call then breaks
    ("UNAVAILABLE: Socket closed", exit 1), sometimes before worker 0's exit is seen: the summary
    names the lost worker, not worker 2's broken call."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['LOCKSTEP_PROCESS_ID'])\n"
        "if rank == 2:\n"
        "    print('jax.errors.JaxRuntimeError: UNAVAILABLE: Socket closed', flush=True)\n"
        "    sys.exit(1)\n"
        "if rank == 0:\n"
        "    time.sleep(0.3)\n"
        f"    print('lockstep: worker 0: lost worker 1: no heartbeat for 10 s', flush=True)\n"
        f"    sys.exit({LOST_WORKER_EXIT_CODE})\n"
        "time.sleep(60)\n")
    proc = launch_workers(script, nproc=3, timeout=60)
    summary = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1
    assert "rank 1 lost; rank 0 exited with code 75" in summary, summary


def test_an_error_raised_as_a_failed_collective_unwinds_still_ends_the_worker_as_having_lost_a_peer():
    """Seen in a stress run: SIGTERM reached worker 1 in a step; worker 0's step failed in gloo, and
    fit's cleanup then read the step's donated arrays ("Array has been deleted"), which hid the gloo
    error: worker 0 exited with 1 and the launcher named it, not worker 1's signal. The worker's
    excepthook now reads the errors the last one was raised while handling."""
    code = ("import sys\nfrom lockstep.cluster._multi_worker import _exit_at_once\n"
            "sys.excepthook = _exit_at_once(sys.excepthook)\n"
            "try:\n    raise RuntimeError('UNKNOWN: Gloo all-reduce failed: Connection reset by peer')\n"
            "finally:\n    raise RuntimeError('Array has been deleted with shape=float32[4,1].')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == LOST_WORKER_EXIT_CODE, proc.stderr[-2000:]
    assert "a collective failed because a peer worker left (RuntimeError)" in proc.stderr


_ES_CACHE = {}


def es_reference_epochs(nproc):
    if nproc not in _ES_CACHE:
        x, y = common.data()
        parts = common.validation_parts(nproc)
        out = {}
        for name, (vx, vy) in [("union", (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))),
                               ("last_worker_alone", parts[-1])]:
            t = common.trainer(ls.MirroredStrategy(1))
            h = t.fit(x, y, batch_size=64, epochs=12, seed=2, verbose=0, validation_data=(vx, vy),
                      callbacks=[ls.callbacks.EarlyStopping(**common.ES)])
            out[name] = h.epoch
        _ES_CACHE[nproc] = out
    return _ES_CACHE[nproc]




@pytest.mark.parametrize("how", ["KILL", "STOP"])
def test_a_dead_or_frozen_worker_ends_the_job_in_bounded_time_and_is_named(how):
    start = time.monotonic()
    proc = launch(WORKERS / "fault_job.py", how, nproc=3, failure_timeout=10)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    summary = proc.stderr.strip().splitlines()[-1]
    if how == "KILL":
        assert "rank 1 killed by SIGKILL" in summary, summary
    else:
        assert "frozen (stopped) rank 1" in summary and "lost worker 1" in summary, summary
    assert elapsed < 60, elapsed  # start-up + failure timeout (10 s) + grace, never a hang
    pid = int(next(line.split()[-1] for line in proc.stdout.splitlines() if "pid" in line))
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"




def test_tf_config_from_the_tf_distribute_docs_works_unchanged():
    script = WORKERS / "tf_config_job.py"
    port_a, port_b = free_port(), free_port()
    # the example of tf.distribute's multi-worker tutorial, with local ports
    tf_config = {"cluster": {"worker": [f"localhost:{port_a}", f"localhost:{port_b}"]}, "task": {"type": "worker"}}
    procs = []
    try:
        for index in range(2):
            cfg = {**tf_config, "task": {"type": "worker", "index": index}}
            env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
            env.update(TF_CONFIG=json.dumps(cfg), XLA_FLAGS=CHILD_XLA_FLAGS, LOCKSTEP_FAILURE_TIMEOUT="10")
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert all(p.returncode == 0 for p in procs), outs
    assert "task 0 chief True replicas 2 total 45.0" in outs[0]
    assert "task 1 chief False replicas 2 total 45.0" in outs[1]


def test_cluster_resolvers_read_env_tf_config_and_slurm():
    r = ls.resolve_cluster({"LOCKSTEP_COORDINATOR_ADDRESS": "h:1", "LOCKSTEP_NUM_PROCESSES": "4",
                            "LOCKSTEP_PROCESS_ID": "3"})
    assert (r.coordinator_address, r.num_workers, r.task_id, r.is_chief) == ("h:1", 4, 3, False)
    cfg = {"cluster": {"chief": ["c:5"], "worker": ["w0:5", "w1:5"]}, "task": {"type": "worker", "index": 1}}
    r = ls.resolve_cluster({"TF_CONFIG": json.dumps(cfg)})
    assert (r.coordinator_address, r.num_workers, r.task_type, r.task_id, r.process_id) == ("c:5", 3, "worker", 1, 2)
    r = ls.resolve_cluster({"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "node[12-15],x",
                            "LOCKSTEP_COORDINATOR_PORT": "7000"})
    assert (r.coordinator_address, r.num_workers, r.is_chief) == ("node12:7000", 8, True)
    with pytest.raises(ValueError, match="no cluster found"):
        ls.resolve_cluster({})
    with pytest.raises(ValueError, match="process_id"):
        ls.ClusterResolver("h:1", 2, 2)
    with pytest.raises(ValueError, match="TF_CONFIG must be JSON"):
        ls.TFConfigClusterResolver("{not json")


def test_launcher_reports_a_failing_script_and_bad_arguments():
    script = WORKERS / "exit_code_job.py"
    proc = launch(script, nproc=2)
    assert proc.returncode == 1
    assert "rank 1 exited with code 3" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "0", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nproc_per_node" in proc.stderr


def test_multi_worker_strategy_after_jax_started_is_a_clear_error():
    jax.numpy.zeros(()).block_until_ready()  # JAX has started in this process
    with pytest.raises(ls.UsageError, match="before any JAX computation"):
        ls.MultiWorkerMirroredStrategy(ls.ClusterResolver("127.0.0.1:1", 2, 0))


def test_launcher_forwards_sigterm_and_leaves_no_process_behind():
    script = WORKERS / "sigterm_job.py"
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", str(script)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = []
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "launcher ended early"
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 1
    assert out.count("got SIGTERM") == 2
    assert "(interrupted)" in err
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}")


def test_workers_passing_arrays_of_different_lengths_get_a_clear_error():
    """Each worker ran its own number of steps and the job died in a Gloo timeout."""
    script = WORKERS / "uneven_rows_job.py"
    proc = launch(script, nproc=2)
    assert proc.returncode != 0
    assert "`x` has a different number of samples on each worker ([20, 23], in worker order)" in proc.stdout


def test_a_chief_whose_peer_never_starts_exits_with_a_named_cause():
    """It aborted with a core dump: `DEADLINE_EXCEEDED ... RegisterTask`."""
    script = WORKERS / "joiner_job.py"
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "LOCKSTEP_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
           "LOCKSTEP_NUM_PROCESSES": "2", "LOCKSTEP_PROCESS_ID": "0", "LOCKSTEP_JOIN_TIMEOUT": "3"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == LOST_WORKER_EXIT_CODE, proc.stderr[-2000:]
    assert "worker 0: not every worker joined the coordinator within 3 s (2 workers expected)" in proc.stderr
    assert "joined\n" not in proc.stdout


def test_a_worker_that_raises_is_named_first_and_the_job_ends_at_once():
    """The raising rank waited ~20 s in the shutdown barrier while its peer's collective timed
    out, and the launcher's summary blamed the healthy rank 0."""
    script = WORKERS / "raiser_job.py"
    start = time.monotonic()
    proc = launch(script, nproc=2, failure_timeout=10)
    assert proc.returncode == 1
    assert "rank 1 exited with code 1 [RuntimeError: boom in rank 1];" in proc.stderr, proc.stderr
    assert "RuntimeError: boom in rank 1" in proc.stdout
    assert time.monotonic() - start < 60  # not the runtime's barrier and collective time-outs


def test_one_worker_calling_fit_while_another_evaluates_is_a_named_error_not_a_hang():
    """Their collectives never met: both waited until the runtime's collective time-out aborted them."""
    script = WORKERS / "disagree_job.py"
    start = time.monotonic()
    proc = launch(script, nproc=2, failure_timeout=10)
    assert proc.returncode == 1
    summary = proc.stderr.strip().splitlines()[-1]
    assert "WorkersDisagreeError: the workers are running different code: worker " in summary, proc.stderr
    for worker, call in ((0, "fit"), (1, "predict")):  # named at the start of each call, before any collective
        assert re.search(f"worker {worker} (reaches|while worker {worker} reaches) the settings of {call}",
                         proc.stdout + proc.stderr), proc.stderr[-3000:]
    assert time.monotonic() - start < 60


def test_a_chief_working_long_after_the_others_finished_is_not_cut_off():
    """The finished worker waited in the runtime's shutdown barrier, which timed out (after twice
    the failure timeout, at least 10 s) and aborted every worker, the busy chief included."""
    script = WORKERS / "long_tail_job.py"
    proc = launch(script, nproc=2, failure_timeout=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("finished 8.0") == 2


def test_a_worker_whose_script_ends_early_is_named_and_the_others_do_not_hang():
    script = WORKERS / "early_end_job.py"
    start = time.monotonic()
    proc = launch(script, nproc=2, failure_timeout=6)
    assert proc.returncode == 1
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("lockstep launch: rank 1 lost; rank 0 exited with code 75"), summary
    assert "lost worker 1: it finished its script" in summary  # seen by the watchdog or the program check
    assert time.monotonic() - start < 60


def _launch_cmd(script, *options):
    return [sys.executable, "-m", "lockstep", "launch", "--failure-timeout", "10", *options, str(script)]


def test_a_port_another_program_takes_before_worker_0_binds_it_is_chosen_again():
    """The launcher chose a free port, and before worker 0 started the coordinator there another
    program took it: worker 0 said its port was in use and the job ended (once in 350 launches of
    the multi-process tests). Now the launcher starts the workers again on another port."""
    from launching import launch_env

    launcher = textwrap.dedent("""
        import socket, sys
        from lockstep.launch import _launcher
        with socket.socket() as busy:  # the first port the launcher chooses is taken
            busy.bind(("127.0.0.1", 0)); busy.listen()
            ports, real = iter([busy.getsockname()[1]]), _launcher.free_port
            _launcher.free_port = lambda: next(ports, None) or real()
            print("taken", busy.getsockname()[1], flush=True)
            sys.exit(_launcher.launch(sys.argv[1], nproc_per_node=2, devices_per_proc=1))
    """)
    proc = subprocess.run([sys.executable, "-c", launcher, str(WORKERS / "joiner_job.py")], capture_output=True,
                          text=True, timeout=120, env=launch_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    taken = proc.stdout.split()[1]
    assert f"port 127.0.0.1:{taken} was taken before worker 0 started" in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("joined") == 2


def test_bad_cluster_settings_are_named_errors_within_seconds():
    script = WORKERS / "joiner_job.py"
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "LOCKSTEP_JOIN_TIMEOUT": "5"}
    run = dict(capture_output=True, text=True, timeout=120, env=env)
    # nodes started with different --nnodes: both named, with both counts
    port = free_port()
    common_opts = ["--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}"]
    a = subprocess.Popen(_launch_cmd(script, *common_opts, "--nnodes", "2", "--node-rank", "0"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    b = subprocess.run(_launch_cmd(script, *common_opts, "--nnodes", "3", "--node-rank", "1"), **run)
    a_out, a_err = a.communicate(timeout=120)
    assert a.returncode == 1 and b.returncode == 1
    assert "worker 0 was started for 2 workers, worker 1 for 3" in a_err.splitlines()[-1], a_err[-2000:]
    assert "worker 1 was started for 3 workers, worker 0 for 2" in b.stderr.splitlines()[-1], b.stderr[-2000:]
    # the coordinator's port is taken by another program
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = subprocess.run(_launch_cmd(script, "--nproc-per-node", "2", "--coordinator",
                                          f"127.0.0.1:{busy.getsockname()[1]}"), **run)
    assert proc.returncode == 1
    assert "rank 0 exited with code 1 [lockstep: worker 0: could not start the coordinator" in proc.stderr
    assert "its port is in use" in proc.stderr
    # a node pointed at a coordinator nobody runs: named within the join time-out
    start = time.monotonic()
    proc = subprocess.run(_launch_cmd(script, "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
                                      "--coordinator", f"127.0.0.1:{free_port()}"), **run)
    assert proc.returncode == 1 and "joined" not in proc.stdout
    assert "could not join the coordinator at 127.0.0.1:" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    assert time.monotonic() - start < 60


@pytest.mark.full_suite  # (about 15 s: `make test` keeps the other bad settings)
def test_nodes_of_other_process_counts_or_a_task_index_given_twice_are_named_errors():
    script = WORKERS / "joiner_job.py"
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "LOCKSTEP_JOIN_TIMEOUT": "5"}
    run = dict(capture_output=True, text=True, timeout=120, env=env)
    # nodes started with different --nproc-per-node: ids taken twice, counts differ (was SIGABRT, ALREADY_EXISTS)
    port = free_port()
    opts = ["--nnodes", "2", "--coordinator", f"127.0.0.1:{port}"]
    a = subprocess.Popen(_launch_cmd(script, *opts, "--nproc-per-node", "2", "--node-rank", "0"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    b = subprocess.run(_launch_cmd(script, *opts, "--nproc-per-node", "1", "--node-rank", "1"), **run)
    a_out, a_err = a.communicate(timeout=120)
    assert a.returncode == 1 and b.returncode == 1 and "joined" not in a_out + b.stdout
    assert "worker 0 was started for 4 workers, worker 1 for 2" in a_err.splitlines()[-1], a_err[-2000:]
    assert "worker 1 was started for 2 workers, worker 0 for 4" in b.stderr.splitlines()[-1], b.stderr[-2000:]
    # the same TF_CONFIG task index twice: every worker says so, or (had worker 0 already seen the
    # whole cluster) the second one says its id was taken; never an abort or a hang. A job that
    # starts stays up past the join time-out (6 s > 5 s), so a late twin finds it there, never a
    # port already closed (which it could not tell from a coordinator not yet started)
    port = free_port()
    def tf_config(index):
        cluster = {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]}
        return {**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
    twins = [subprocess.Popen([sys.executable, str(script), "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=tf_config(1)) for _ in range(2)]
    chief = subprocess.run([sys.executable, str(script), "6"], **{**run, "env": tf_config(0)})
    twin_errs = [t.communicate(timeout=120)[1] for t in twins]
    claimed = "worker id 1 was claimed twice"
    if chief.returncode == 0:
        assert sorted(t.returncode for t in twins) == [0, 1], twin_errs
        late = twin_errs[[t.returncode for t in twins].index(1)]
        assert "was worker id 1 started twice" in late.splitlines()[-1], late[-2000:]
    else:
        assert [chief.returncode] + [t.returncode for t in twins] == [1, 1, 1], chief.stderr[-2000:]
        for err in [chief.stderr, *twin_errs]:
            assert claimed in err.splitlines()[-1], err[-2000:]


def test_workers_passing_arrays_or_batches_of_other_content_get_a_clear_error():
    """Each worker shuffled its copy of the arrays with its own seed: the lengths agreed, an epoch
    trained on 188 distinct of 256 samples, and `evaluate` was off, without a word."""
    script = WORKERS / "other_content_job.py"
    proc = launch(script, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("shuffled x and y: `x` holds other values on worker [1] than on worker 0 (the same 256 "
                     "samples in number; checksums [") == 2, out
    assert out.count("other y: `y` holds other values on worker [1] than on worker 0") == 2, out
    assert out.count("other validation y: `y` of `validation_data` holds other values on worker [1]") == 2, out
    assert out.count("evaluate: `x` holds other values on worker [1]") == 2, out
    assert out.count("batches: the first batch of this pass differs on worker [1] from worker 0's") == 2, out
    assert out.count("the same arrays everywhere: trained") == 2, out


DIFFERS = {"epochs": "the settings of fit: epochs is 2 on worker 0 and 3 on worker 1",
           "shuffle": "the settings of fit: shuffle is false on worker 0 and true on worker 1",
           "seed": "the settings of fit: seed is 0 on worker 0 and 1 on worker 1",
           "Trainer seed": "the settings of fit: model_seed is 0 on worker 0 and 1 on worker 1",
           "learning rate": "the Keras variable 'sgd_\\d+/learning_rate' \\(a scalar: a setting such as a learning "
                            "rate\\) with other values: \\[0.00999.*, 0.0199.*\\], in worker order",
           "ZeRO stage": "the settings of fit: the sharding .*zero_stage=1.* on worker 0 and .*zero_stage=3.* on worker 1",
           "layout rule": "the settings of fit: the sharding .*'.\\*out/kernel', \\(None, None\\).* on worker 0 and "
                          ".*'.\\*out/kernel', \\('model', None\\).* on worker 1",
           "batches": "the batches of a pass .*: the checksum of batches 2-257 is \\d+ on worker 0 and \\d+ on worker 1",
           "EarlyStopping": "the callbacks that decide .*: EarlyStopping 1 is .*\"restore_best_weights\": false.* on "
                            "worker 0 and .*\"restore_best_weights\": true.* on worker 1",
           "reset_metrics": "a callback reset the metrics \\(`reset_metrics\\(\\)`.* on some workers and not on others .*\\[0, 1\\]",
           "reset_state": "a callback reset the metrics .*a metric object's `reset_state\\(\\)`.* on some workers and not on "
                          "others .*\\[0, 1\\]",
           "reset_state at the end": "a callback reset the metrics .* on some workers and not on others .*\\[0, 1\\]",
           "stale update": "a callback changed (the|a) metric object.* other than by reset_state\\(\\)",
           "reset_state as a resumed epoch ends": "a callback reset the metrics .* on some workers and not on others"}


def test_workers_whose_settings_or_batches_differ_are_named_before_a_step_mixes_them(tmp_path):
    """Before: different epochs ended in a gloo time-out (the launcher exiting 0); one worker
    shuffling, another Trainer(seed=) or batches that differ after the first trained a mix; a
    learning rate, ZeRO stage or layout rule of its own: JAX's AssertionError or gloo's SIGABRT; an
    EarlyStopping restoring the best weights on worker 1 alone: gloo's time-out. A stop asked by a
    callback of worker 1's alone was dropped at an epoch's end (worker 0's decided) and left worker 0
    in a collective in a batch; a fit TerminateOnNaN stopped ended in JAX's AssertionError (NaN
    weights compared across workers). Both now stop where Keras' own fit does."""
    proc = launch(WORKERS / "differ_job.py", tmp_path, nproc=2, devices=2, failure_timeout=20)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = rank_results(proc, 2)
    for result in results:
        assert set(result["caught"]) == set(DIFFERS)
        for case, message in DIFFERS.items():
            assert re.search(message, result["caught"][case]), (case, result["caught"][case])
    # a progress bar on worker 0 alone (verbose=1 there, 0 on worker 1) trains, both alike
    assert results[0]["loss"] == results[1]["loss"] and "Epoch 2/2" in proc.stdout + proc.stderr
    # 40 rows in batches of 8: stopped after batch 1 (2 steps), after epoch 0 (5 steps), and by
    # TerminateOnNaN where Keras' own fit of the same model stops (SGD at 1.0 diverges)
    keras.utils.set_random_seed(0)
    alone = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    alone.compile(keras.optimizers.SGD(1.0), "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.normal(size=(40, 1)).astype("float32")
    nan = alone.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[keras.callbacks.TerminateOnNaN()])
    want_nan = [len(nan.history["loss"]), int(alone.optimizer.iterations), True]
    assert want_nan[:2] == [2, 6]
    for result in results:
        assert result["stopped"] == {"batch": [1, 2], "epoch": [1, 5], "nan": want_nan}


@pytest.mark.parametrize("target, sig", [("worker", signal.SIGTERM), ("launcher", signal.SIGINT),
                                         pytest.param("launcher", signal.SIGTERM, marks=pytest.mark.full_suite),
                                         pytest.param("worker", signal.SIGINT, marks=pytest.mark.full_suite)])
def test_sigterm_or_sigint_ends_a_job_without_backups_every_process_reaped(target, sig):
    """Before: the runtime's preemption notifier took SIGTERM, and a job without BackupAndRestore
    was still training 90 s after SIGTERM reached the launcher or one worker."""
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", "--failure-timeout", "10",
           str(WORKERS / "no_backup_job.py")]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS})
    pids = {}
    try:
        while True:
            line = launcher.stdout.readline()
            assert line, "the job ended before the signal"
            if " pid " in line:
                pids[line.split()[1]] = int(line.split()[-1])
            if "epoch 1" in line and len(pids) == 2:
                break
        sent = time.monotonic()
        if target == "worker":
            os.kill(pids["1]"], sig)
        else:
            launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 1, err[-3000:]
    summary = err.strip().splitlines()[-1]
    code = 128 + sig
    assert f"exited with code {code}" in summary and "stopped all 2 worker processes" in summary, summary
    if target == "worker":
        assert f"rank 1 exited with code {code} [lockstep: worker 1: {signal.Signals(sig).name} received" in summary
    else:
        assert summary.endswith("(interrupted)")
    assert took < 10  # well within the failure timeout
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}")


def test_worker_0_started_twice_is_named_by_both():
    """Before: the second worker 0 said its coordinator's port was in use, and the first waited
    30 s for a worker 1 that never came."""
    script = WORKERS / "joiner_job.py"
    port = free_port()
    cluster = {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]}
    env = {**os.environ, "XLA_FLAGS": CHILD_XLA_FLAGS, "LOCKSTEP_JOIN_TIMEOUT": "20",
           "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})}
    start = time.monotonic()
    twins = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    errs = [t.communicate(timeout=120)[1] for t in twins]
    assert [t.returncode for t in twins] == [1, 1], errs
    for err in errs:
        assert "worker id 0 was claimed twice" in err.splitlines()[-1], err[-2000:]
    assert time.monotonic() - start < 20  # named at once, not after the join time-out
