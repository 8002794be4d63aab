"""Network partitions between two nodes, with counts: a node's link taken down mid-training, many times.

    python benchmarks/partitions.py                  # 20 trials of each scenario (needs root and `ip`)
    python benchmarks/partitions.py --trials 3       # a quick look

Each trial creates two Linux network namespaces joined by a bridge (`tests/nodes.py`; each node's
/etc/hosts maps the host name to a loopback address, as Debian's does), runs one
`lockstep launch --nnodes 2 --failure-timeout 10` per node (1 worker x 2 devices each, the job of
`tests/workers/node_job.py`), and takes one node's link down at step 8:

* worker-link / coordinator-link: node 1's or node 0's link down: both launchers exit 1, each
  worker's last line names what it lost (node 0: "lost worker 1", node 1: "lost contact with the
  coordinator"), within the failure timeout + 5 s, without SIGABRT or a core dump;
* restart: node 1's link down, then up again once node 0 restarts (`--max-restarts 1`): both
  launchers exit 0 and the job ends with the weights of one device (float32 tolerance).

Detection time is from the cut to the later of the two launchers' summary (or "restarting") lines.
Orphans are processes still alive in a node after its launcher exited; leftovers are namespaces
left behind. Appends its table to `benchmarks/FAULTS.md` (`--out`), replacing an older one.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "workers")]

import nodes as multi  # noqa: E402  (the tests' namespaces)

FAILURE_TIMEOUT = 10
PORT = 29531
JOB = os.path.join(TESTS, "workers", "node_job.py")
SCENARIOS = {"worker-link": "node 1's link down (a worker's node)",
             "coordinator-link": "node 0's link down (the coordinator's node)",
             "restart": "node 1's link down, then up, `--max-restarts 1`"}
HEADING = "## Partitions between two nodes"


class Reader:
    """A launcher's output lines, each with the time it was read."""

    def __init__(self, proc: subprocess.Popen[str]):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    def wait_for(self, text: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = self.first(text)
            if found is not None:
                return found
            time.sleep(0.05)
        return self.first(text)

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def _launch(net: multi.Nodes, k: int, out_dir: str, restarts: int) -> Reader:
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nnodes", "2", "--node-rank", str(k), "--coordinator",
           f"{net.address(0)}:{PORT}", "--devices-per-proc", "2", "--failure-timeout", str(FAILURE_TIMEOUT),
           "--max-restarts", str(restarts), JOB, out_dir, "slow"]
    env = {**os.environ, "XLA_FLAGS": "", "KERAS_BACKEND": "jax", "LOCKSTEP_JOIN_TIMEOUT": "30"}
    return Reader(net.run(k, cmd, env=env))


def _orphans(out_dir: str) -> int:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(out_dir in line for line in ps.splitlines())


def run_trial(scenario: str, reference: np.ndarray) -> dict:
    out_dir = tempfile.mkdtemp(prefix="lockstep-partition-")
    cut = 0 if scenario == "coordinator-link" else 1
    restarts = 1 if scenario == "restart" else 0
    why, detected = [], None
    with multi.Nodes(2) as net:
        readers = [_launch(net, k, out_dir, restarts) for k in range(2)]
        if readers[0].wait_for("[rank 0] step 8", 180) is None:
            why.append("never reached step 8: " + readers[0].text()[-800:])
        net.link(cut, up=False)
        cut_at = time.monotonic()
        if scenario == "restart":
            seen = [r.wait_for("restarting the workers", 4 * FAILURE_TIMEOUT) for r in readers]
            net.link(cut, up=True)
        for r in readers:
            try:
                r.proc.wait(240)
            except subprocess.TimeoutExpired:
                why.append("a launcher did not end in 240 s")
            r.thread.join(5)
        if scenario != "restart":
            seen = [r.first("lockstep launch:") for r in readers]
        if all(s is not None for s in seen):
            detected = max(seen) - cut_at
        codes = [r.proc.returncode for r in readers]
        texts = [r.text() for r in readers]
        net.close()  # kills what is left in the nodes: what it had to kill are orphans
        orphans = len(net.orphans) + _orphans(out_dir)
    leftovers = len(multi.leftovers())
    dumps = sum(("SIGABRT" in t) + ("core dumped" in t) + ("Check failure" in t) for t in texts)
    want = [0, 0] if scenario == "restart" else [1, 1]
    if codes != want:
        why.append(f"exit codes {codes}, expected {want}")
    names = ["lost worker 1", "lost contact with the coordinator"]
    named = all(names[k] in texts[k] for k in range(2))
    if scenario != "restart":
        for k in range(2):
            if names[k] not in texts[k]:
                why.append(f"node {k} did not name its loss ({names[k]!r}): " + texts[k][-600:])
    else:
        try:
            got = np.load(os.path.join(out_dir, "final.npz"))["weights"]
            if not np.allclose(got, reference, rtol=2e-5, atol=2e-6):
                why.append("the resumed weights differ from one device's")
        except OSError as e:
            why.append(f"no result: {e}")
    if detected is None or detected > FAILURE_TIMEOUT + 5:
        why.append(f"detected after {detected} s")
    return {"ok": not why and not dumps and not orphans and not leftovers, "named": named, "detected": detected,
            "dumps": dumps,
            "orphans": orphans, "leftovers": leftovers, "why": "; ".join(why)}


def _fmt(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}" if values else "—"


def write_table(rows: dict[str, list[dict]], path: str, elapsed: float) -> None:
    lines = [HEADING, "",
             f"Written by `python benchmarks/partitions.py --trials {len(next(iter(rows.values())))}` on "
             f"{platform.node()} ({os.cpu_count()} CPUs), in {elapsed / 60:.0f} min. Two nodes are two Linux network "
             "namespaces on a bridge, each with a loopback host name in its /etc/hosts; one `lockstep launch "
             f"--failure-timeout {FAILURE_TIMEOUT}` per node (1 worker x 2 devices); a link taken down at step 8. "
             "Detection: from the cut to the later launcher's summary (or restart) line, in seconds.", "",
             "| scenario | runs | correct | named on both sides | detection s (min / median / max) | core dumps "
             "| orphans | namespaces left |", "|---|---|---|---|---|---|---|---|"]
    for scenario, trials in rows.items():
        named = f"{sum(t['named'] for t in trials)}/{len(trials)}"
        lines.append(f"| {SCENARIOS[scenario]} | {len(trials)} | {sum(t['ok'] for t in trials)} | {named} | "
                     f"{_fmt([t['detected'] for t in trials if t['detected'] is not None])} | "
                     f"{sum(t['dumps'] for t in trials)} | {sum(t['orphans'] for t in trials)} | "
                     f"{sum(t['leftovers'] for t in trials)} |")
    lines += [f"- {s}: {t['why'][:800]}" for s, ts in rows.items() for t in ts if t["why"]]
    old = open(path).read() if os.path.exists(path) else ""
    old = old.split(HEADING)[0].rstrip() + "\n\n" if old else ""
    with open(path, "w") as f:
        f.write(old + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out", default=os.path.join(HERE, "FAULTS.md"))
    args = parser.parse_args(argv)
    reason = multi.skip_reason()
    if reason:
        print(f"partitions: cannot run here: {reason}", file=sys.stderr)
        return 2
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax

    import lockstep as ls
    import node_job

    t, _ = node_job.run(ls.MirroredStrategy(1))
    reference = np.concatenate([np.ravel(w) for w in jax.tree.leaves(t.get_weights())])
    start = time.monotonic()
    rows: dict[str, list[dict]] = {}
    for scenario in args.scenarios:
        rows[scenario] = []
        for i in range(args.trials):
            trial = run_trial(scenario, reference)
            rows[scenario].append(trial)
            print(f"{scenario:16s} trial {i + 1}/{args.trials}: {'ok' if trial['ok'] else 'WRONG'} "
                  f"detected={trial['detected']} {trial['why'][:300]}", flush=True)
    write_table(rows, args.out, time.monotonic() - start)
    return 0 if all(t["ok"] for ts in rows.values() for t in ts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
