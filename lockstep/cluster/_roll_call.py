"""The workers' roll call, before JAX's runtime starts: every worker id taken once, by workers
started for the same number of workers.

JAX's coordination service aborts a process (SIGABRT, `ALREADY_EXISTS`) when two workers claim
the same id (the same TF_CONFIG index twice, or launchers started with different
`--nproc-per-node`), and a worker started for another number of workers waits until a time-out.
So worker 0 first listens on the coordinator's port itself, takes a line from every worker
(its id, its number of workers, its host and pid), and answers each "ok" once all ids are
there, or the first problem, named, to all; then it closes the port and starts the runtime's
coordinator there.

>>> _decode(_encode({"rank": 1, "num": 2, "who": "node1 pid 7"}))
{'rank': 1, 'num': 2, 'who': 'node1 pid 7'}
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from .._errors import UsageError

_MAGIC = b"lockstep-roll-call-1 "


class PortBusyError(OSError):
    """Worker 0 could not listen on the coordinator's port."""


def _encode(message: dict[str, Any]) -> bytes:
    return _MAGIC + json.dumps(message).encode() + b"\n"


def _decode(line: bytes | None) -> dict[str, Any] | None:
    if not line or not line.startswith(_MAGIC):
        return None
    try:
        message = json.loads(line[len(_MAGIC):])
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _read_line(conn: socket.socket, limit: int = 65536) -> bytes | None:
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < limit:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        return data or None
    return data or None


def _who() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def host(address: str, num: int) -> None:
    """Worker 0: holds the roll call on the coordinator's port; returns once every id is there.

    Raises:
      PortBusyError: the port is in use.
      UsageError: a worker was started for another number of workers, or an id was claimed twice
        (every waiting worker is told the same).
    """
    _, port = _split(address)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closing connection's port is free
    try:
        server.bind(("0.0.0.0", port))
    except OSError as e:
        server.close()
        raise PortBusyError(e.errno, e.strerror or str(e)) from None
    server.listen(256)
    server.settimeout(0.2)
    here: dict[int, str] = {0: _who()}
    waiting: list[socket.socket] = []
    try:
        while True:
            if len(here) == num:  # one more look for a worker that already knocks: a duplicate id
                server.settimeout(0.1)
            try:
                conn, _ = server.accept()
            except socket.timeout:
                if len(here) == num:
                    break
                continue
            conn.settimeout(10.0)
            message = _decode(_read_line(conn))
            if message is None:  # a port probe or another program: not a worker
                conn.close()
                continue
            rank, their_num, who = message.get("rank"), message.get("num"), message.get("who", "?")
            if their_num != num:
                _stop(server, waiting + [conn], f"worker {rank} was started for {their_num} workers, worker 0 for "
                      f"{num}", f"worker 0 was started for {num} workers, worker {rank} for {their_num}")
            if rank in here:
                _stop(server, waiting + [conn], None, f"worker id {rank} was claimed twice ({here[rank]}, and "
                      f"{who}): each of the {num} workers needs its own id")
            here[rank] = who
            waiting.append(conn)
        for conn in waiting:
            _send(conn, {"ok": True})
        for conn in waiting:  # each worker closes first: the port is left with no connection of ours
            conn.settimeout(2.0)
            _read_line(conn)
    finally:
        for conn in waiting:
            conn.close()
        server.close()


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.sendall(_encode(message))
    except OSError:
        pass  # that worker is gone: its launcher says so


def _stop(server: socket.socket, conns: list[socket.socket], theirs: str | None, ours: str) -> None:
    """Tells every waiting worker the problem (`theirs` to the last, the newcomer), and every worker
    already knocking (queued on `server`, not yet accepted) ours, then raises ours: no worker of
    the job is left to find the port closed under it and blame the coordinator."""
    advice = ("start every worker with the same --nnodes and --nproc-per-node and its own --node-rank (or "
              "the same TF_CONFIG cluster and its own task index, or SLURM settings)")
    for i, conn in enumerate(conns):
        text = theirs if theirs is not None and i == len(conns) - 1 else ours
        _send(conn, {"error": f"{text}: {advice}."})
        conn.close()
    server.settimeout(0.2)
    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # (a timeout included) nobody else knocks
            break
        with conn:
            conn.settimeout(2.0)
            _read_line(conn)
            _send(conn, {"error": f"{ours}: {advice}."})
    raise UsageError(f"{ours}: {advice}.")


def answer(address: str, num: int, rank: int) -> None:
    """Worker `rank` > 0: reports to worker 0's roll call and waits for its answer (bounded by the
    caller's join deadline).

    Raises:
      UsageError: worker 0 named a problem, or something other than a lockstep roll call answered
        at the coordinator's address (the job there has already started with all its workers).
    """
    hostname, port = _split(address)
    while True:
        try:
            conn = socket.create_connection((hostname, port), timeout=2.0)
        except OSError:
            time.sleep(0.05)  # worker 0 is not listening yet
            continue
        break
    with conn:
        conn.settimeout(None)  # worker 0 answers when every worker is there
        try:
            conn.sendall(_encode({"rank": rank, "num": num, "who": _who()}))
        except OSError:
            pass
        reply = _decode(_read_line(conn))
    if reply is not None and reply.get("ok"):
        return
    if reply is not None and "error" in reply:
        raise UsageError(str(reply["error"]))
    raise UsageError(
        f"worker {rank}: the coordinator at {address} did not answer as a lockstep worker 0 that waits for its "
        f"workers: worker 0 stopped, or a job there has already started with all its {num} workers (was worker id "
        f"{rank} started twice: the same TF_CONFIG index or --node-rank?), or another program listens there.")


def second_worker_0(address: str, num: int, wait: float = 3.0) -> None:
    """Worker 0 that found the coordinator's port in use: asks whoever listens there whether it is
    a lockstep worker 0 holding its roll call (worker 0 started twice). That one names the id
    claimed twice to every worker, this one included, and this raises it; anything else (another
    program, a job that has started) answers nothing within `wait` s, and this returns.

    Raises:
      UsageError: a lockstep worker 0 holds its roll call there (worker id 0 claimed twice).
    """
    hostname, port = _split(address)
    deadline = time.monotonic() + wait
    while True:
        try:
            conn = socket.create_connection((hostname, port), timeout=wait)
            break
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)  # the other worker 0 has bound the port, and listens a moment later
    with conn:
        conn.settimeout(wait)
        try:
            conn.sendall(_encode({"rank": 0, "num": num, "who": _who()}))
        except OSError:
            return
        reply = _decode(_read_line(conn))
    if reply is not None and "error" in reply:
        raise UsageError(str(reply["error"]))
