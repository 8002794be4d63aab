"""Workers agree on each new compiled program before running it.

Every worker of a multi-worker job must run the same compiled programs in the same order: their
collectives meet only then. When one worker calls `fit` while another calls `evaluate`, or their
batches have different shapes, the collectives would wait for each other until the runtime's
time-out aborts both, naming nobody. So, the first time a worker runs a program, it publishes a
short description of it (the function and its argument shapes) in the coordination service and
reads every other worker's description of its program of the same number: different descriptions,
or a worker that publishes none within the failure timeout, raise `WorkersDisagreeError` naming
the workers and what each runs. A worker that is waited for but whose script has already
finished ends the waiting worker with the lost-worker exit code (75) and a line naming it, as the
watchdog does. A program every worker has already run is not checked again.
"""

from __future__ import annotations

import os
import sys

from .._errors import WorkersDisagreeError
from .._exit_codes import LOST_WORKER_EXIT_CODE
from ._coordination import Coordination


class ProgramAgreement:
    """Checks, through the coordination service, that all workers run the same new program."""

    def __init__(self, rank: int, num_workers: int, timeout: float):
        self._service = Coordination()
        self._rank, self._num, self._timeout = rank, num_workers, timeout
        self._count = 0

    def check(self, description: str) -> None:
        """Publishes this worker's next new program and compares it with every other worker's."""
        n = self._count
        self._count += 1
        mine = description[:2000]
        self._service.publish(f"lockstep/program/{n}/", self._rank, mine)
        theirs = self._wait_for_all(f"lockstep/program/{n}/")
        for r in range(self._num):
            if r not in theirs:
                raise WorkersDisagreeError(
                    f"worker {r} did not start new program number {n} within {self._timeout:g} s, while worker "
                    f"{self._rank} starts {description}: the workers are running different code (say, one calls "
                    f"fit while another calls evaluate, or one runs more steps), or worker {r} is that much slower.")
            if theirs[r] != mine:
                raise WorkersDisagreeError(
                    f"the workers are about to run different programs (number {n}): worker {self._rank} runs "
                    f"{description}, worker {r} runs {theirs[r]}. Every worker must make the same calls with "
                    "batches of the same shapes (say, all call fit, with the same batch_size).")

    def _wait_for_all(self, prefix: str) -> dict[int, str]:
        """Every worker's entry under `prefix`, or those there when the time-out expires."""
        def check(found: dict[int, str]) -> None:  # waiting a while: a missing worker whose script has finished never comes
            gone = sorted(set(self._service.by_rank("lockstep/done/")) - set(found))
            if gone:
                self._lost(gone[0], prefix)
        return self._service.wait_for(prefix, self._num, self._timeout, check=check)

    def _lost(self, worker: int, prefix: str) -> None:
        """Ends this worker as the watchdog ends one that lost a peer (the same exit code and words)."""
        print(f"lockstep: worker {self._rank}: lost worker {worker}: it finished its script while this worker "
              f"waits for it to start program number {prefix.rstrip('/').rsplit('/', 1)[-1]} (the workers ran "
              f"different numbers of steps); exiting with code {LOST_WORKER_EXIT_CODE}.", file=sys.stderr, flush=True)
        os._exit(LOST_WORKER_EXIT_CODE)
