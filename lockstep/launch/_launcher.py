"""`lockstep launch`: start the worker processes of one node, watch them, stop them all together."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import IO

from .._exit_codes import LOST_WORKER_EXIT_CODE, PORT_TAKEN_EXIT_CODE, PREEMPTED_EXIT_CODE

_PR_SET_PDEATHSIG = 1
_PRINT_LOCK = threading.Lock()  # one whole line at a time from the workers' reader threads
# a runtime call that broke because a peer (or the coordinator, on worker 0) had gone: a consequence
_CONNECTION_LOST = re.compile(r"JaxRuntimeError: (UNAVAILABLE|CANCELLED|ABORTED)\b")
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")  # `KeyError: 'x'`


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    if rc == LOST_WORKER_EXIT_CODE:
        return f"exited with code {rc} (lost a peer worker)"
    if rc == PREEMPTED_EXIT_CODE:
        return f"exited with code {rc} (preempted; backup saved)"
    return f"exited with code {rc}"


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen[bytes], out: IO[str]):
        self.rank, self.proc = rank, proc
        self.tail: deque[str] = deque(maxlen=20)
        self._thread = threading.Thread(target=self._pump, args=(out,), daemon=True)
        self._thread.start()

    def _pump(self, out: IO[str]) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            with _PRINT_LOCK:
                print(f"[rank {self.rank}] {line}", file=out, flush=True)
        self.proc.stdout.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def last_message(self) -> str | None:
        """The worker's last `lockstep:` line (which may follow a part line the worker was printing
        when it ended), else the last line of a Python traceback it printed."""
        for line in reversed(self.tail):
            if "lockstep: worker" in line or line.startswith("lockstep:"):
                return line[line.index("lockstep:"):]
        for line in reversed(self.tail):
            if _ERROR_LINE.match(line):
                return line[:600]
        return None


def launch(script: str, args: Sequence[str] = (), nproc_per_node: int = 1, nnodes: int = 1, node_rank: int = 0,
           coordinator: str | None = None, devices_per_proc: int | None = None, failure_timeout: float = 20.0,
           max_restarts: int = 0, grace: float = 5.0, out: IO[str] | None = None, err: IO[str] | None = None,
           socket_ifname: str | None = None) -> int:
    """Runs `script` in `nproc_per_node` worker processes of this node; returns the exit code.

    Each worker gets LOCKSTEP_COORDINATOR_ADDRESS, LOCKSTEP_NUM_PROCESSES, LOCKSTEP_PROCESS_ID
    (and LOCKSTEP_NNODES, LOCKSTEP_DEVICES_PER_PROC, LOCKSTEP_FAILURE_TIMEOUT, LOCKSTEP_RESTART_COUNT, and
    LOCKSTEP_SOCKET_IFNAME: the network interface of the collectives, else the one that routes to
    the coordinator). Output
    lines are prefixed with the rank. When a worker fails or is preempted, the others are
    stopped (SIGTERM, then SIGKILL after `grace` seconds) and a one-line summary names the failed
    rank (and any frozen one); the group is started again up to `max_restarts` times (with
    `BackupAndRestore`, training continues where it stopped), else the exit code is 1.
    SIGINT and SIGTERM sent to the launcher are forwarded to the workers and end the job.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    for name, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {name}={value!r}.")
    if devices_per_proc is not None and (not isinstance(devices_per_proc, int) or devices_per_proc < 1):
        raise ValueError(f"`devices_per_proc` must be a positive integer, got devices_per_proc={devices_per_proc!r}.")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"`max_restarts` must be a non-negative integer, got max_restarts={max_restarts!r}.")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"`node_rank` must be in [0, {nnodes}), got node_rank={node_rank!r}.")
    if coordinator is None and nnodes > 1:
        raise ValueError("`coordinator` (host:port of node 0) is needed when `nnodes` > 1.")
    if not os.path.exists(script):
        raise FileNotFoundError(f"`script` does not exist: {script!r}.")
    stopping = threading.Event()
    workers: list[_Worker] = []

    def forward(signum: int, frame: object) -> None:
        stopping.set()
        for w in workers:
            w.signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        attempt, taken = 0, 0
        while attempt <= max_restarts:
            address = coordinator or f"127.0.0.1:{free_port()}"
            workers.clear()
            summary = _run_group(workers, script, args, nproc_per_node, nnodes, node_rank, address,
                                 devices_per_proc, failure_timeout, attempt, grace, out, stopping, socket_ifname,
                                 chosen=coordinator is None)
            if summary is None:
                return 0
            if (coordinator is None and taken < 3 and not stopping.is_set()
                    and any(w.proc.returncode == PORT_TAKEN_EXIT_CODE for w in workers)):
                taken += 1  # the free port chosen was taken before worker 0 bound it: again, on another
                print(f"lockstep launch: port {address} was taken before worker 0 started the coordinator there; "
                      "starting the workers again on another.", file=err, flush=True)
                continue
            print(summary + (" (interrupted)" if stopping.is_set() else ""), file=err, flush=True)
            if stopping.is_set() or attempt == max_restarts:
                return 1
            print(f"lockstep launch: restarting the workers (restart {attempt + 1} of {max_restarts}).",
                  file=err, flush=True)
            attempt += 1
        return 1
    finally:
        _stop_all(workers, grace)
        for s, h in old.items():
            signal.signal(s, h)


def _run_group(workers: list[_Worker], script: str, args: Sequence[str], nproc_per_node: int, nnodes: int,
               node_rank: int, coordinator: str, devices_per_proc: int | None, failure_timeout: float,
               attempt: int, grace: float, out: IO[str], stopping: threading.Event,
               socket_ifname: str | None = None, chosen: bool = False) -> str | None:
    """Starts one group of workers and waits; returns None on success, else a summary line.
    `chosen`: the launcher chose the coordinator's port (`PORT_TAKEN_EXIT_CODE`)."""
    world = nnodes * nproc_per_node
    for i in range(nproc_per_node):
        rank = node_rank * nproc_per_node + i
        env = {**os.environ, "LOCKSTEP_COORDINATOR_ADDRESS": coordinator, "LOCKSTEP_NUM_PROCESSES": str(world),
               "LOCKSTEP_PROCESS_ID": str(rank), "LOCKSTEP_FAILURE_TIMEOUT": str(failure_timeout),
               "LOCKSTEP_RESTART_COUNT": str(attempt), "LOCKSTEP_NNODES": str(nnodes), "PYTHONUNBUFFERED": "1"}
        if socket_ifname:
            env["LOCKSTEP_SOCKET_IFNAME"] = socket_ifname
        if chosen:
            env["LOCKSTEP_COORDINATOR_CHOSEN"] = "1"
        if devices_per_proc is not None:
            env["LOCKSTEP_DEVICES_PER_PROC"] = str(devices_per_proc)
        proc = subprocess.Popen([sys.executable, "-u", script, *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        workers.append(_Worker(rank, proc, out))
    failed: _Worker | None = None
    finished: list[_Worker] = []  # in the order they exited with code 0
    while True:
        codes = [w.proc.poll() for w in workers]
        finished += [w for w, rc in zip(workers, codes) if rc == 0 and w not in finished]
        bad = [w for w, rc in zip(workers, codes) if rc not in (None, 0)]
        if bad:
            failed = _first_cause(workers, bad)
            break
        if all(rc == 0 for rc in codes):
            break
        time.sleep(0.05)
    if failed is None:
        for w in workers:
            w.join(5.0)
        return None
    frozen = [w.rank for w in workers if w.proc.poll() is None and _is_stopped(w.proc.pid)]
    _stop_all(workers, grace)
    return _summary(failed, frozen, finished, len(workers))


def _summary(failed: _Worker, frozen: list[int], finished: list[_Worker], count: int) -> str:
    """One line, the failed worker first: frozen ranks, else the lost worker a survivor named,
    else ranks that exited 0 while the others still trained; then the first exit and its message."""
    rc = failed.proc.returncode
    message = failed.last_message()
    parts = []
    lost = re.search(r"lost worker (\d+)", message or "") if rc == LOST_WORKER_EXIT_CODE else None
    if frozen:
        parts.append(f"frozen (stopped) rank{'s' if len(frozen) > 1 else ''} {', '.join(map(str, frozen))}")
    elif lost:
        parts.append(f"rank {lost.group(1)} lost")
    elif finished and rc in (LOST_WORKER_EXIT_CODE, -signal.SIGABRT):
        # the others lost a peer that had simply finished: the workers ran different numbers of steps
        parts.append(f"rank{'s' if len(finished) > 1 else ''} {', '.join(str(w.rank) for w in finished)} exited "
                     "early (code 0) while the others were still running")
    parts.append(f"rank {failed.rank} {_describe(rc)}" + (f" [{message}]" if message else ""))
    return f"lockstep launch: {'; '.join(parts)}; stopped all {count} worker processes."


def _first_cause(workers: list[_Worker], bad: list[_Worker], settle: float = 1.0) -> _Worker:
    """The failed worker to name: one that failed by itself (an error of its own) rather than one
    that only lost a peer (code 75, or a runtime call cut off: "UNAVAILABLE: Socket closed") or
    was killed, waiting up to `settle` s for the peer whose exit caused theirs."""
    deadline = time.monotonic() + settle
    read: set[int] = set()
    while True:
        codes = [(w, w.proc.poll()) for w in workers]
        for w, rc in codes:
            if rc is not None and w.rank not in read:  # its last lines read before they are judged
                w.join(0.5)
                read.add(w.rank)
        own = [w for w, rc in codes if rc is not None and rc > 0 and rc != LOST_WORKER_EXIT_CODE
               and not _CONNECTION_LOST.search(w.last_message() or "")]
        if own:
            return own[0]
        if time.monotonic() > deadline:  # else one killed from outside (not the runtime's own abort)
            killed = [w for w, rc in codes if rc is not None and rc < 0 and rc != -signal.SIGABRT]
            # else a survivor whose watchdog named the lost worker, rather than one whose collective
            # merely broke when that survivor left (several workers: only the first knows who is lost)
            named = [w for w, rc in codes if rc == LOST_WORKER_EXIT_CODE and "lost worker" in (w.last_message() or "")]
            return (killed or named or bad)[0]
        time.sleep(0.05)


def _stop_all(workers: list[_Worker], grace: float) -> None:
    alive = [w for w in workers if w.proc.poll() is None]
    for w in alive:
        w.signal(signal.SIGTERM)
        w.signal(signal.SIGCONT)  # a stopped (frozen) process handles SIGTERM only once continued
    deadline = time.monotonic() + grace
    for w in alive:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        w.signal(signal.SIGKILL)  # the whole process group: no orphans
        try:
            w.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        w.join(5.0)
