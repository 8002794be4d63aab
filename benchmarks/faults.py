"""Fault injection with counts: every way a worker can fail, many times, through `lockstep launch`.

    python benchmarks/faults.py                      # 20 trials of each scenario, 2 and 3 workers
    python benchmarks/faults.py --trials 3 --scenarios kill stop   # a quick look

Each trial starts a job with `lockstep launch --failure-timeout 10` (the worker script is
`benchmarks/_fault_worker.py`), injects one fault into one worker, and checks the outcome:

* kill / stop / raise / coordinator: the job ends with exit code 1 and the launcher's summary
  names the failed worker first (and, for a frozen one, the watchdog's "lost worker k");
* exit0: a worker's script ends early (exit code 0) while the others still train: the others stop
  waiting for it and the summary names it;
* slow: a worker that sleeps 0.6 failure timeouts at three steps is not declared dead (exit 0);
* term: one worker is preempted (SIGTERM): every worker saves a backup at the same step and the
  job ends with code 83 (or, where the step they agree on falls after the last one, every worker
  finishes training with the uninterrupted run's weights and history); term-restart: the same with `--max-restarts 1`, and the job then
  finishes with the weights and history of the uninterrupted run;
* savekill: a worker is killed inside a backup save; every checkpoint left on disk restores
  whole, and a second launch resumes and finishes with the uninterrupted run's weights and history.

Detection time is from the victim's ``FAULT <time>`` line to the launcher's summary (or its
"restarting" line). Orphans are processes of the trial still alive after the launcher exits.
Writes a table to `benchmarks/FAULTS.md` (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_fault_worker.py")
FAILURE_TIMEOUT = 10.0
SCENARIOS = ["kill", "stop", "raise", "exit0", "coordinator", "slow", "term", "term-restart", "termnobackup", "savekill",
             "zerokill", "damagekill"]
DESCRIPTIONS = {
    "kill": "a worker SIGKILLed mid-training",
    "stop": "a worker frozen (SIGSTOP)",
    "raise": "a worker raises in the middle of training",
    "exit0": "a worker exits 0 early, the others still training",
    "coordinator": "the coordinator (rank 0) SIGKILLed",
    "slow": "a worker only slow (3 pauses of 0.6 failure timeouts)",
    "term": "a worker preempted (SIGTERM), no restarts",
    "term-restart": "a worker preempted (SIGTERM), `--max-restarts 1`",
    "termnobackup": "a worker sent SIGTERM in a fit without `BackupAndRestore`",
    "savekill": "a worker SIGKILLed inside a backup save, then resumed",
    "zerokill": "a worker SIGKILLed at a step where it holds no real row, `--max-restarts 1`",
    "damagekill": "the newest backup bit-flipped on disk, a worker SIGKILLed, `--max-restarts 1`",
}


@dataclass
class Trial:
    correct: bool
    why: str = ""
    detection: float | None = None
    orphans: int = 0
    corrupt: int = 0
    equal: bool | None = None
    finished: bool = False  # `term`: the agreed save step fell after the last step, so training finished


@dataclass
class Row:
    scenario: str
    workers: int
    trials: list[Trial] = field(default_factory=list)


def _launch(token: str, out_dir: str, scenario: str, victim: int, workers: int, restarts: int = 0,
            timeout: float = 300) -> tuple[int, list[tuple[float, str]], list[tuple[float, str]]]:
    """Runs one job; returns its exit code and its stdout / stderr lines with arrival times."""
    cmd = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", str(workers), "--failure-timeout",
           str(FAILURE_TIMEOUT), "--max-restarts", str(restarts), WORKER, token, out_dir,
           scenario.split("-")[0] if scenario != "coordinator" else "kill", str(victim)]
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: dict[str, list[tuple[float, str]]] = {"out": [], "err": []}

    def pump(stream, key):
        for line in stream:
            lines[key].append((time.time(), line.rstrip("\n")))

    threads = [threading.Thread(target=pump, args=(proc.stdout, "out")),
               threading.Thread(target=pump, args=(proc.stderr, "err"))]
    for t in threads:
        t.start()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        lines["err"].append((time.time(), "faults.py: the launcher did not end within its time limit (HANG)"))
    for t in threads:
        t.join(10)
    return rc, lines["out"], lines["err"]


def _orphans(token: str) -> int:
    """Processes of this trial still alive; they are killed after being counted."""
    found = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmdline and state != "Z":
            found += 1
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
    return found


def _tail(out: list[tuple[float, str]], chars: int = 600) -> str:
    """The workers' last output lines, stack dumps left out (for the table's notes on wrong outcomes)."""
    lines = [line for _, line in out if "    @ " not in line and line.strip()]
    return " / ".join(lines[-6:])[-chars:]


def _fault_time(out: list[tuple[float, str]]) -> float | None:
    for _, line in out:
        if "] FAULT " in line:
            return float(line.split("FAULT ")[1])
    return None


def _is_summary(line: str) -> bool:
    return line.startswith("lockstep launch:") and "restarting" not in line


def _line_time(err: list[tuple[float, str]], text: str) -> float | None:
    for t, line in err:
        if text in line:
            return t
    return None


def _result(out_dir: str) -> tuple[np.ndarray, dict] | None:
    try:
        with open(os.path.join(out_dir, "history.json")) as f:
            return np.load(os.path.join(out_dir, "weights.npy")), json.load(f)
    except OSError:
        return None


def _check_checkpoints(directory: str) -> int:
    """How many checkpoints listed in `directory` fail to restore whole (or do not restore)."""
    import jax

    from lockstep.checkpoint import TrainingCheckpointer

    store = TrainingCheckpointer(directory)
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # written by several workers: read onto one device
    bad = 0
    try:
        for step in store.all_steps():
            try:
                arrays, meta = store.restore(step, default_sharding=here)
                if meta.get("global_step", step) != step or not arrays:
                    bad += 1
            except Exception:  # noqa: BLE001 - a checkpoint that does not restore is what we count
                bad += 1
    finally:
        store.close()
    return bad


def run_trial(scenario: str, workers: int, reference: tuple[np.ndarray, dict] | None) -> Trial:
    token = f"lockstep-fault-{uuid.uuid4().hex[:12]}"
    out_dir = tempfile.mkdtemp(prefix="lockstep-faults-")
    victim = 0 if scenario == "coordinator" else workers - 1
    try:
        restarts = 1 if scenario in ("term-restart", "zerokill", "damagekill") else 0
        rc, out, err = _launch(token, out_dir, scenario, victim, workers, restarts)
        orphans = _orphans(token)
        summary = next((line for _, line in reversed(err) if _is_summary(line)), "")
        fault = _fault_time(out)
        text = "\n".join(line for _, line in err)
        if "HANG" in text:
            return Trial(False, "hang", orphans=orphans)
        if scenario == "slow":
            ok = rc == 0 and "lost worker" not in text
            return Trial(ok, "" if ok else f"rc={rc}: {summary or text[-300:]} | {_tail(out)}", orphans=orphans)
        if fault is None:
            return Trial(False, f"no fault injected (rc={rc}): {text[-300:]}", orphans=orphans)
        if scenario in ("term-restart", "zerokill", "damagekill"):
            detected = _line_time(err, "restarting the workers")
            res = _result(out_dir)
            equal = res is not None and reference is not None and bool(
                np.array_equal(res[0], reference[0]) and res[1] == reference[1])
            ok = rc == 0 and detected is not None and equal
            if scenario == "damagekill":  # every worker named the damaged backup, which was set aside
                every = "\n".join(line for _, line in out + err)
                ok = ok and every.count("the backup of step 15 is damaged") == workers and os.path.isdir(
                    os.path.join(out_dir, "backup", "damaged", "15"))
            return Trial(ok, "" if ok else f"rc={rc} equal={equal}: {summary}", detection=_since(fault, detected),
                         orphans=orphans, equal=equal)
        if scenario == "term" and rc == 0:
            # the runtime agrees on the save step a little after the signal: when that step fell after the
            # last one, every worker finished training (exit 0): correct if the signal was taken as a
            # preemption (the victim says so) and nothing was lost
            res = _result(out_dir)
            equal = res is not None and reference is not None and bool(
                np.array_equal(res[0], reference[0]) and res[1] == reference[1])
            taken = any(f"worker {victim}: SIGTERM received: every worker backs up" in line for _, line in out + err)
            return Trial(equal and taken, "" if equal and taken else
                         f"finished (rc 0): signal taken {taken}, equal {equal} | {_tail(out)}",
                         orphans=orphans, equal=equal, finished=True)
        detected = next((t for t, line in err if _is_summary(line)), None)
        expected = {
            "kill": f"rank {victim} killed by SIGKILL",
            "coordinator": "rank 0 killed by SIGKILL",
            "stop": f"lost worker {victim}",
            "raise": f"rank {victim} exited with code 1",
            "exit0": f"rank {victim} lost",
            "term": "exited with code 83 (preempted; backup saved)",
            "termnobackup": f"rank {victim} exited with code 143 [lockstep: worker {victim}: SIGTERM received",
            "savekill": f"rank {victim} killed by SIGKILL",
        }[scenario]
        ok = rc == 1 and expected in summary
        if scenario == "stop":
            ok = ok and f"frozen (stopped) rank {victim}" in summary
        if scenario == "raise":
            ok = ok and "injected failure" in summary
        if scenario == "exit0":
            ok = ok and "finished its script" in summary
        trial = Trial(ok, "" if ok else f"rc={rc}: {summary or text[-300:]} | {_tail(out)}", detection=_since(fault, detected),
                      orphans=orphans)
        if scenario in ("term", "savekill"):
            trial.corrupt = _check_checkpoints(os.path.join(out_dir, "backup"))
        if scenario == "savekill":
            rc2, out2, err2 = _launch(token, out_dir, "plain", victim, workers)
            trial.orphans += _orphans(token)
            res = _result(out_dir)
            trial.equal = res is not None and reference is not None and bool(
                np.array_equal(res[0], reference[0]) and res[1] == reference[1])
            if rc2 != 0 or not trial.equal:
                trial.correct = False
                trial.why = f"resume rc={rc2} equal={trial.equal}: " + "\n".join(line for _, line in err2)[-300:]
        trial.correct = trial.correct and trial.corrupt == 0
        return trial
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def reference_run(workers: int, scenario: str = "plain") -> tuple[np.ndarray, dict]:
    """The uninterrupted run (`zeroplain`: on the data of `zerokill`)."""
    out_dir = tempfile.mkdtemp(prefix="lockstep-faults-ref-")
    try:
        rc, _, err = _launch("lockstep-fault-ref", out_dir, scenario, 0, workers)
        res = _result(out_dir)
        if rc != 0 or res is None:
            raise SystemExit("the uninterrupted run failed:\n" + "\n".join(line for _, line in err)[-3000:])
        return res
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _fmt(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def write_table(rows: list[Row], path: str, trials: int, elapsed: float) -> None:
    lines = [
        "# Fault injection: outcomes over repeated trials",
        "",
        f"Written by `python benchmarks/faults.py --trials {trials}` (`make faults`) on {platform.node() or 'this machine'}"
        f" ({os.cpu_count()} CPUs, Python {platform.python_version()}), in {elapsed / 60:.0f} min.",
        f"Every trial runs `lockstep launch --failure-timeout {FAILURE_TIMEOUT:g}` on 127.0.0.1; a correct outcome is "
        "the exit code and launcher summary listed in `benchmarks/faults.py` (the failed worker named first), and "
        "for restarts the uninterrupted run's weights (bitwise) and history. Detection: from the fault to the "
        "launcher's summary line (or its restart line), in seconds; the limit is the failure timeout + 5 s = "
        f"{FAILURE_TIMEOUT + 5:g} s.",
        "",
        "| scenario | workers | runs | correct | detection s (min / median / max) | orphans | corrupt checkpoints "
        "| equals uninterrupted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        det = [t.detection for t in row.trials if t.detection is not None]
        eq = [t.equal for t in row.trials if t.equal is not None]
        lines.append(
            f"| {DESCRIPTIONS[row.scenario]} | {row.workers} | {len(row.trials)} | "
            f"{sum(t.correct for t in row.trials)} | {_fmt(det)} | {sum(t.orphans for t in row.trials)} | "
            f"{sum(t.corrupt for t in row.trials)} | {f'{sum(eq)}/{len(eq)}' if eq else '—'} |")
    finished = [(row, sum(t.finished for t in row.trials)) for row in rows]
    if any(n for _, n in finished):
        lines += ["", "Counted correct: preempted trials in which the save step the workers agreed on fell after "
                  "the last step, so every worker finished training (exit 0) with the uninterrupted run's weights: "
                  + ", ".join(f"{n} of {len(row.trials)} ({row.workers} workers)" for row, n in finished if n) + "."]
    failures = [(row, t) for row in rows for t in row.trials if not t.correct]
    if failures:
        lines += ["", "## Incorrect outcomes", ""]
        lines += [f"- {row.scenario}, {row.workers} workers: {t.why[:1000]}" for row, t in failures]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    parser.add_argument("--out", default=os.path.join(HERE, "FAULTS.md"))
    args = parser.parse_args(argv)
    start = time.monotonic()
    rows = []
    for workers in args.workers:
        references = {}
        if {"term", "term-restart", "savekill", "damagekill"} & set(args.scenarios):
            references["plain"] = reference_run(workers)
        if "zerokill" in args.scenarios:
            references["zeroplain"] = reference_run(workers, "zeroplain")
        for scenario in args.scenarios:
            row = Row(scenario, workers)
            rows.append(row)
            for i in range(args.trials):
                trial = run_trial(scenario, workers, references.get("zeroplain" if scenario == "zerokill" else "plain"))
                row.trials.append(trial)
                det = "-" if trial.detection is None else f"{trial.detection:.1f}s"
                print(f"{scenario:12s} workers={workers} trial {i + 1}/{args.trials}: "
                      f"{'ok' if trial.correct else 'WRONG'} detection={det} orphans={trial.orphans}"
                      + ("" if trial.correct else f"  {trial.why[:300]}"), flush=True)
            write_table(rows, args.out, args.trials, time.monotonic() - start)
    wrong = sum(not t.correct for row in rows for t in row.trials)
    print(f"{wrong} incorrect outcomes; table written to {args.out}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
