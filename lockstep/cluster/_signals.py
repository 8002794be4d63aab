"""SIGTERM and SIGINT end a worker of a job, whatever it is doing.

`jax.distributed.initialize` installs the runtime's preemption notifier as the C handler of
SIGTERM: it records the signal for a preemption sync point (which `BackupAndRestore` uses: every
worker backs up at one step, then exits 83) and otherwise ignores it, so a job without backups
went on training after the launcher or the cluster had asked it to stop. Once a worker has joined,
`install` puts lockstep's handler in front of it:

- while a `BackupAndRestore` runs a `fit` (`backups_take_sigterm`), SIGTERM is passed on to the
  runtime's notifier, as before (the graceful preemption);
- otherwise SIGTERM or SIGINT ends the worker at once, with one line saying so and the code
  128 + the signal's number (143, 130); the launcher then stops the others and names it.

The handler acts from a thread woken by the signal (Python's wakeup file descriptor), so a main
thread held in a collective or a compilation does not delay it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any

_BACKUPS: list[object] = []  # the BackupAndRestore objects whose fit takes SIGTERM as a preemption


def backups_take_sigterm(owner: object, on: bool) -> None:
    """`owner` (a `BackupAndRestore` in a fit of several workers) takes SIGTERM as a preemption
    (`on`), or no longer does."""
    if on:
        _BACKUPS.append(owner)
    elif owner in _BACKUPS:
        _BACKUPS.remove(owner)


def _c_handler(sig: int) -> Any:
    """The C function installed for `sig` (the runtime's notifier), callable, or None (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(256)  # a struct sigaction; its handler comes first
        if libc.sigaction(sig, None, action) != 0:
            return None
        address = int.from_bytes(action.raw[:ctypes.sizeof(ctypes.c_void_p)], sys.byteorder)
    except (OSError, AttributeError):
        return None
    if address in (0, 1):  # SIG_DFL, SIG_IGN
        return None
    return ctypes.CFUNCTYPE(None, ctypes.c_int)(address)


class _Ending:
    def __init__(self, rank: int):
        self._rank = rank
        self._notifier = _c_handler(signal.SIGTERM) if signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL, signal.SIG_IGN, None) else None  # the runtime's C handler, not Python's own

    def handle(self, signum: int, frame: Any = None) -> None:
        """The Python handler (main thread); the watching thread acts first where it runs (acting
        twice is harmless: both end the process, or both tell the runtime)."""
        self.act(signum)

    def act(self, signum: int) -> None:
        if signum == signal.SIGTERM and _BACKUPS and self._notifier is not None:
            self._say(f"lockstep: worker {self._rank}: SIGTERM received: every worker backs up at a step they agree "
                      "on and exits with code 83 (a fit that ends first ends as usual).\n")
            self._notifier(signum)  # the runtime records it; BackupAndRestore backs up and stops
            return
        name = signal.Signals(signum).name
        why = " (no BackupAndRestore backs up this fit)" if signum == signal.SIGTERM else ""
        self._say(f"lockstep: worker {self._rank}: {name} received{why}: ending this worker now, exit code {128 + signum}.\n")
        os._exit(128 + signum)

    @staticmethod
    def _say(line: str) -> None:
        os.write(sys.__stderr__.fileno() if sys.__stderr__ else 2, line.encode())  # no stream lock to wait on

    def watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            for signum in data:  # a handler the user installed since is left to act alone
                if signum in (signal.SIGTERM, signal.SIGINT) and signal.getsignal(signum) == self.handle:
                    self.act(signum)


def install(rank: int) -> None:
    """Once this worker has joined its job (after `jax.distributed.initialize`): SIGTERM and SIGINT
    end it (see the module docstring). Only from the main thread; otherwise nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    ending = _Ending(rank)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, ending.handle)
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        return
    threading.Thread(target=ending.watch, args=(read,), daemon=True, name="lockstep-signals").start()
