"""Several nodes for real: each node a Linux network namespace with its own address (10.77.0.k),
joined by a bridge (`nodes.Nodes`), one `lockstep launch` per node. Every node's /etc/hosts maps
the host name to a loopback address, as Debian's does: the workers must find the address that
reaches the other nodes themselves. Partitions (a node's link taken down) are named on both
sides, within the failure timeout, without a core dump; with `--max-restarts` the job resumes
once the link is back and ends as the uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import lockstep as ls
import nodes as multi
from launching import WORKERS, launch_env, resume_result

import node_job  # noqa: E402

SKIP = multi.skip_reason()
pytestmark = [pytest.mark.xdist_group("processes"), pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]

JOB = WORKERS / "node_job.py"
PORT = 29511
TIMEOUT = 10  # the failure timeout of these jobs: a lost peer is named within it


def launcher(nodes, k, out_dir, *args, nproc=1, devices=2, restarts=0, options=()):
    """`lockstep launch` on node k of `nodes` (a Popen), running the node job."""
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nnodes", str(nodes.n), "--node-rank", str(k),
           "--coordinator", f"{nodes.address(0)}:{PORT}", "--nproc-per-node", str(nproc), "--devices-per-proc",
           str(devices), "--failure-timeout", str(TIMEOUT), "--max-restarts", str(restarts), *options,
           str(JOB), str(out_dir), *args]
    return nodes.run(k, cmd, env=launch_env({"LOCKSTEP_JOIN_TIMEOUT": "30"}))


def finish(procs, timeout=240):
    """Each launcher's (exit code, output), waiting at most `timeout` s for all."""
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            out += "\n<<killed by the test: did not end in time>>"
        results.append((p.returncode, out))
    return results


def assert_equals_one_device(out_dir):
    """The job's final weights and history (written by worker 0) are one device's."""
    weights, hist = resume_result(out_dir)
    t, want = node_job.run(ls.MirroredStrategy(1))
    np.testing.assert_allclose(weights, np.concatenate([np.ravel(w) for w in jax.tree.leaves(t.get_weights())]),
                               rtol=2e-5, atol=2e-6)
    for name, values in want.history.items():
        np.testing.assert_allclose(hist["history"][name], values, rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.full_suite)])
def test_two_nodes_with_a_loopback_host_name_train_as_one_device(nproc, tmp_path):
    """The host name resolves to 127.0.1.1 on both nodes (it once made gloo advertise a loopback
    address: "Connection refused, remote=[127.0.0.1]"); 2 nodes x `nproc` processes x 2 devices."""
    with multi.Nodes(2, hosts="loopback") as net:
        results = finish([launcher(net, k, tmp_path, nproc=nproc) for k in range(2)])
    for rc, out in results:
        assert rc == 0, out[-4000:]
    assert f"of {2 * nproc} ({4 * nproc} replicas) finished" in results[0][1]
    assert_equals_one_device(tmp_path)


def read_until(proc, text, lines, timeout=120):
    """Reads `proc`'s output into `lines` until a line contains `text`; the time it was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"the job ended before printing {text!r}:\n" + "".join(lines[-60:])
        lines.append(line)
        if text in line:
            return time.monotonic()
    raise AssertionError(f"no {text!r} within {timeout} s:\n" + "".join(lines[-60:]))


# the link of a worker's node, or (make test-full) of the coordinator's node
@pytest.mark.parametrize("cut", [1, pytest.param(0, marks=pytest.mark.full_suite)])
def test_a_partition_is_named_on_both_sides_within_the_failure_timeout(cut, tmp_path):
    with multi.Nodes(2) as net:
        procs = [launcher(net, k, tmp_path, "slow") for k in range(2)]
        lines = []
        read_until(procs[0], "[rank 0] step 8", lines)
        net.link(cut, up=False)
        cut_at = time.monotonic()
        results = finish(procs, timeout=4 * TIMEOUT + 30)
        ended = time.monotonic() - cut_at
    outs = ["".join(lines) + results[0][1], results[1][1]]
    for k, (rc, _) in enumerate(results):
        print(f"--- node {k}: exit {rc}, {ended:.0f} s after the cut\n" + outs[k][-2500:])
    for k, (rc, _) in enumerate(results):
        assert rc == 1, outs[k][-3000:]
        assert "SIGABRT" not in outs[k] and "core dumped" not in outs[k], outs[k][-3000:]
        assert "code 75 (lost a peer worker)" in outs[k], outs[k][-3000:]
    assert ended < 2 * TIMEOUT + 10


@pytest.mark.full_suite  # 45 s: make test-full
def test_a_job_cut_off_by_a_partition_restarts_once_the_link_is_back_and_equals_one_device(tmp_path):
    """Node 1's link down at step 8, up again once node 0's launcher restarts: with --max-restarts 1
    both nodes restart, resume from the newest backup and end as one device does."""
    with multi.Nodes(2) as net:
        procs = [launcher(net, k, tmp_path, "slow", restarts=1) for k in range(2)]
        lines = []
        read_until(procs[0], "[rank 0] step 8", lines)
        net.link(1, up=False)
        read_until(procs[0], "restarting the workers", lines, timeout=3 * TIMEOUT)
        net.link(1, up=True)
        results = finish(procs)
    outs = ["".join(lines) + results[0][1], results[1][1]]
    for k, (rc, _) in enumerate(results):
        assert rc == 0, outs[k][-3000:]
        assert "restart 1 of 1" in outs[k] and "SIGABRT" not in outs[k], outs[k][-3000:]
    assert resume_result(tmp_path)[1]["restored_from"] is not None
    assert_equals_one_device(tmp_path)


def test_a_node_that_never_arrives_is_named_within_the_join_timeout(tmp_path):
    with multi.Nodes(2) as net:
        cmd = [sys.executable, "-m", "lockstep", "launch", "--nnodes", "2", "--node-rank", "0", "--coordinator",
               f"{net.address(0)}:{PORT}", str(JOB), str(tmp_path)]
        start = time.monotonic()
        [(rc, out)] = finish([net.run(0, cmd, env=launch_env({"LOCKSTEP_JOIN_TIMEOUT": "8"}))], timeout=60)
    assert rc == 1, out
    assert "not every worker joined the coordinator within 8 s (2 workers expected)" in out, out
    assert "SIGABRT" not in out and time.monotonic() - start < 40


def cluster_env(kind, k, net):
    """The environment of node k's one worker under TF_CONFIG or SLURM (2 devices each)."""
    env = {"LOCKSTEP_DEVICES_PER_PROC": "2", "LOCKSTEP_FAILURE_TIMEOUT": str(TIMEOUT)}
    if kind == "TF_CONFIG":
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"node{j}:{PORT}" for j in range(net.n)]},
                                       "task": {"type": "worker", "index": k}})
    else:
        env.update(SLURM_NTASKS=str(net.n), SLURM_PROCID=str(k), SLURM_JOB_NODELIST=f"node[0-{net.n - 1}]",
                   SLURM_JOB_NUM_NODES=str(net.n), LOCKSTEP_COORDINATOR_PORT=str(PORT))
    return launch_env(env)


@pytest.mark.full_suite
@pytest.mark.parametrize("kind", ["TF_CONFIG", "SLURM"])
def test_two_nodes_started_by_tf_config_or_slurm_train_as_one_device(kind, tmp_path):
    with multi.Nodes(2) as net:
        results = finish([net.run(k, [sys.executable, "-u", str(JOB), str(tmp_path)], env=cluster_env(kind, k, net))
                          for k in range(2)])
    for rc, out in results:
        assert rc == 0, out[-3000:]
    assert "worker 0 of 2 (4 replicas) finished" in results[0][1]
    assert_equals_one_device(tmp_path)


def test_a_loopback_address_on_several_nodes_is_named_before_any_step(tmp_path):
    """--socket-ifname lo on a 2-node job: a clear error on every worker, at once (no time-out)."""
    with multi.Nodes(2) as net:
        procs = [launcher(net, k, tmp_path, options=("--socket-ifname", "lo")) for k in range(2)]
        results = finish(procs, timeout=60)
    for rc, out in results:
        assert rc == 1, out[-3000:]
        assert "the job spans 2 nodes, but this worker's address for the collectives is the loopback address " \
               "127.0.0.1 (from LOCKSTEP_SOCKET_IFNAME=lo)" in out, out[-3000:]
        assert "finished" not in out
