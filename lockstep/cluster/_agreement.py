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

Settings that change what a program computes without changing its description (the epochs of a
`fit`, its shuffle and seed, a learning rate, a ZeRO stage or layout rule, the contents of the
batches after the first) are compared the same way with `check_values`: a dict of named values,
published by every worker at the same point (a `fit`'s start, a pass's end); the first that
differs raises `WorkersDisagreeError` naming it and both workers' values.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .._errors import WorkersDisagreeError
from .._exit_codes import LOST_WORKER_EXIT_CODE
from ._coordination import Coordination


class ProgramAgreement:
    """Checks, through the coordination service, that all workers run the same new program and
    have the same values where they compare them. Programs and values are numbered in one
    sequence, so a worker that starts a program while another compares values (one calls `fit`,
    another `predict`) meets it at the same number, and both are named."""

    def __init__(self, rank: int, num_workers: int, timeout: float):
        self._service = Coordination()
        self._rank, self._num, self._timeout = rank, num_workers, timeout
        self._count = 0

    def _exchange(self, mine: list[Any], doing: str) -> list[list[Any]]:
        """Publishes this worker's next entry (``["program", description]`` or ``["values", what,
        values]``) and returns every worker's of the same number, in worker order."""
        n = self._count
        self._count += 1
        self._service.publish(f"lockstep/agree/{n}/", self._rank, json.dumps(mine, default=repr))
        if n >= 2:  # every worker has read entry n - 2 (it has published n - 1): the store stays small
            self._service.delete(f"lockstep/agree/{n - 2}/", self._rank)
        theirs = self._wait_for_all(f"lockstep/agree/{n}/")
        every = []
        for r in range(self._num):
            if r not in theirs:
                raise WorkersDisagreeError(
                    f"worker {r} did not come to step {n} of the job within {self._timeout:g} s, while worker "
                    f"{self._rank} {doing}: the workers are running different code (say, one calls fit while another "
                    f"calls evaluate, or one runs more steps), or worker {r} is that much slower.")
            entry = json.loads(theirs[r])
            if entry[0] != mine[0] or (mine[0] == "values" and entry[1] != mine[1]):
                raise WorkersDisagreeError(
                    f"the workers are running different code: worker {self._rank} {doing} while worker {r} "
                    f"{_doing(entry)} (say, one calls fit while another calls evaluate or predict). Every worker of "
                    "a job makes the same calls in the same order.")
            every.append(entry)
        return every

    def check(self, description: str) -> None:
        """Publishes this worker's next new program and compares it with every other worker's."""
        mine = ["program", description[:2000]]
        for r, entry in enumerate(self._exchange(mine, _doing(mine))):
            if entry != mine:
                raise WorkersDisagreeError(
                    f"the workers are about to run different programs: worker {self._rank} runs "
                    f"{description}, worker {r} runs {entry[1]}. Every worker must make the same calls with "
                    "batches of the same shapes (say, all call fit, with the same batch_size).")

    def gather(self, what: str, value: Any) -> list[Any]:
        """Every worker's `value` (JSON data) at `what`, in worker order."""
        mine = ["values", what, value]
        return [entry[2] for entry in self._exchange(mine, _doing(mine))]

    def check_values(self, what: str, values: dict[str, Any]) -> None:
        """Compares this worker's `values` (JSON data, by name) at `what` with every other worker's."""
        every = self.gather(what, values)
        first = every[0]  # each worker compares with worker 0: every worker raises the same words
        for r, other in enumerate(every):
            for name in [*first, *(k for k in other if k not in first)]:  # in the order given
                if first.get(name) != other.get(name):
                    raise WorkersDisagreeError(
                        f"the workers differ in {what}: {name} is {_shown(first.get(name))} on worker 0 "
                        f"and {_shown(other.get(name))} on worker {r}. Every worker of a job runs the same script "
                        "with the same settings and data (its rows are split by lockstep); whatever differs would "
                        "mix two trainings or stall the collectives.")

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
              f"waits for it at step {prefix.rstrip('/').rsplit('/', 1)[-1]} of the job (a new program or a "
              "comparison: the workers ran different numbers of steps); exiting with code "
              f"{LOST_WORKER_EXIT_CODE}.", file=sys.stderr, flush=True)
        os._exit(LOST_WORKER_EXIT_CODE)


def _doing(entry: list[Any]) -> str:
    return f"starts the program {entry[1]}" if entry[0] == "program" else f"reaches {entry[1]}"


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 300 else text[:300] + "..."
