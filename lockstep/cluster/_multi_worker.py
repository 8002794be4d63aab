"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over several processes.

Built on JAX's own distributed runtime (`jax.distributed`: a coordination service, gloo
collectives on CPU, NCCL on GPU). Each process is a *worker*; the replicas are all devices of
all workers. Start the workers with `lockstep launch`, or give each the environment below.

On each of two machines (or twice on one, with different ids)::

    LOCKSTEP_COORDINATOR_ADDRESS=10.0.0.1:29500 LOCKSTEP_NUM_PROCESSES=2 LOCKSTEP_PROCESS_ID=0 python train.py
    LOCKSTEP_COORDINATOR_ADDRESS=10.0.0.1:29500 LOCKSTEP_NUM_PROCESSES=2 LOCKSTEP_PROCESS_ID=1 python train.py

No hangs: a watchdog thread makes a worker whose peer died or froze exit with
`LOST_WORKER_EXIT_CODE` and a one-line message naming that peer, half the failure timeout
(`failure_timeout`, default `LOCKSTEP_FAILURE_TIMEOUT`, else 20 s) after the peer's last
heartbeat. The runtime's own heartbeat and collective time-outs are backstops, set to twice the
failure timeout, so that the watchdog's named exit wins the race: when they fire, they abort the
process (SIGABRT) without saying which peer was lost. The watchdog also names a peer whose script
has finished while this worker waits in a step that peer never joins, and at exit every worker
waits (still beating) until all have finished, instead of the runtime's shutdown barrier, which
aborts every worker when one finishes more than its time-out later than the others. Before each
new compiled program, the workers check that they all run the same one (`_agreement`); before the
runtime starts, worker 0's roll call checks every worker's id and worker count (`_roll_call`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from . import _roll_call as roll_call
from . import _signals as signals
from . import _transport as transport
from ._agreement import ProgramAgreement
from ._coordination import Coordination
from ._resolvers import LOCAL, ClusterResolver, cluster_configured, resolve_cluster
from .._errors import UsageError
from .._exit_codes import LOST_WORKER_EXIT_CODE, PORT_TAKEN_EXIT_CODE
from ..distribute import Strategy, checked_communication_options

DEFAULT_FAILURE_TIMEOUT = 20.0
# a peer silent for _WATCHDOG x failure_timeout is declared lost by the watchdog (named exit);
# the runtime's own time-outs, which abort without naming anyone, are _BACKSTOP x failure_timeout
_WATCHDOG = 0.5
_BACKSTOP = 2.0
_BEAT_INTERVAL = 1.0


class _Watchdog:
    """Counts heartbeats of every worker in the coordination service; names a silent one and exits.

    At exit (`finish`) a worker publishes that it is done and waits, still beating, until every
    worker is: a chief that saves files long after the others finished is not cut off by the
    runtime's shutdown barrier (which aborts every worker after its time-out).

    A second thread watches the time since the coordinator last answered: cut off from it (its
    node down, the network partitioned), a call to the coordination service waits without end,
    and the runtime's own heartbeat would abort this process (SIGABRT) without naming anything.
    """

    def __init__(self, rank: int, num: int, timeout: float, coordinator: str = "worker 0"):
        self._service = Coordination()
        self._rank, self._num, self._timeout, self._coordinator = rank, num, timeout, coordinator
        self._finishing = False
        self._contact = time.monotonic()  # when the coordinator last answered
        self._done = threading.Event()  # ends the heartbeat loop
        self._thread = threading.Thread(target=self._loop, name="lockstep-watchdog", daemon=True)
        self._clock = threading.Thread(target=self._watch_contact, name="lockstep-watchdog-contact", daemon=True)
        atexit.register(self.finish)  # after JAX's own exit handler is registered: runs before it

    def start(self) -> None:
        self._contact = time.monotonic()
        self._thread.start()
        self._clock.start()

    def _watch_contact(self) -> None:
        while not self._done.wait(_BEAT_INTERVAL / 4):
            silent = time.monotonic() - self._contact
            if silent > self._timeout + _BEAT_INTERVAL:
                self._die(f"lost contact with the coordinator at {self._coordinator} (worker 0's node): no answer for "
                          f"{silent:.0f} s (that node is down, or the network between the nodes is cut)")

    def finish(self) -> None:
        """Publishes that this worker is done, then waits for every other worker to be done."""
        if self._finishing:
            return
        self._finishing = True
        try:
            self._service.publish("lockstep/done/", self._rank, "1", overwrite=True)
            # the heartbeat loop keeps running meanwhile: a lost peer ends this process, named
            self._service.wait_for("lockstep/done/", self._num, longest=0.5)
        except Exception:  # noqa: BLE001 - the coordinator is gone: the heartbeat loop names it
            time.sleep(3 * _BEAT_INTERVAL)
        self._done.set()
        for thread in (self._thread, self._clock):  # not left inside a call into the runtime while Python
            if thread.is_alive() and thread is not threading.current_thread():  # finalizes (an abort:
                thread.join(2 * _BEAT_INTERVAL + 1.0)  # "FATAL: exception not rethrown")

    def _loop(self) -> None:
        last_seen = {r: (None, time.monotonic()) for r in range(self._num)}
        finished_at: dict[int, float] = {}
        waiting = _MainThreadWait()
        while not self._done.wait(_BEAT_INTERVAL):
            now = time.monotonic()
            try:
                self._service.increment("lockstep/beat/", self._rank)
                beats = self._service.by_rank("lockstep/beat/")
                done = set(self._service.by_rank("lockstep/done/"))
                self._contact = time.monotonic()
            except Exception as e:  # noqa: BLE001 - any failure to reach the coordinator
                if self._done.is_set():
                    return
                self._die(f"lost contact with the coordinator (worker 0): {type(e).__name__}: {str(e)[:200]}")
                return
            blocked = waiting.seconds(now)
            for r in range(self._num):
                if r == self._rank:
                    continue
                if r in done:
                    # a peer that has finished cannot join a collective this worker still waits in
                    since = finished_at.setdefault(r, now)
                    if not self._finishing and now - since > self._timeout and blocked > self._timeout:
                        self._die(f"lost worker {r}: it finished its script while this worker has waited "
                                  f"{blocked:.0f} s in a step it never joined (the workers ran different "
                                  "numbers of steps)")
                        return
                    continue
                count = beats.get(r)
                seen, since = last_seen[r]
                if count != seen:
                    last_seen[r] = (count, now)
                elif now - since > self._timeout:
                    self._die(f"lost worker {r}: no heartbeat for {now - since:.0f} s (dead, frozen, or cut off by the network)")
                    return

    def _die(self, why: str) -> None:
        print(f"lockstep: worker {self._rank}: {why}; exiting with code {LOST_WORKER_EXIT_CODE}.",
              file=sys.stderr, flush=True)
        os._exit(LOST_WORKER_EXIT_CODE)


class _MainThreadWait:
    """How long the main thread has been stuck in one call inside JAX or lockstep (the same frame
    at the same instruction, as when blocked on a collective), sampled once a heartbeat."""

    _DIRS = tuple(os.path.dirname(m.__file__ or m.__name__) + os.sep for m in (jax, sys.modules[__package__]))

    def __init__(self) -> None:
        self._main = threading.main_thread().ident
        self._where: tuple[Any, int] | None = None  # holding the frame keeps its identity unique
        self._since = 0.0

    def seconds(self, now: float) -> float:
        frame = sys._current_frames().get(self._main)  # noqa: SLF001 - the documented way to sample a thread
        where = None
        if frame is not None and frame.f_code.co_filename.startswith(self._DIRS):
            where = (frame, frame.f_lasti)
        if where is None or self._where is None or where[0] is not self._where[0] or where[1] != self._where[1]:
            self._where, self._since = where, now
            return 0.0
        return now - self._since


def _exit_at_once(previous: Any) -> Any:
    """An excepthook that prints the error, then ends this worker at once with code 1: the normal
    exit would first wait in the runtime's shutdown barrier for peers that are still training (~20 s
    of noise, while a peer's collective times out and the launcher blames that peer)."""
    def hook(kind: Any, value: Any, tb: Any) -> None:
        previous(kind, value, tb)
        text = "\n".join(map(str, _chain(value)))  # (a cleanup's error may hide the collective's that caused it)
        code = 1
        if "Gloo context initialization failed" in text:
            print(f"lockstep: worker {jax.process_index()}: the collectives could not connect to a peer worker "
                  f"({text.strip().splitlines()[-1][:300]}): a firewall, or a peer listening on an address this node "
                  f"cannot reach; name the network interface with --socket-ifname ({transport.IFNAME_VARIABLE}); "
                  "exiting with code 1.", file=sys.stderr, flush=True)
        elif any(k in text for k in ("Gloo", "Connection closed by peer", "Connection reset", "DEADLINE_EXCEEDED")):
            code = LOST_WORKER_EXIT_CODE  # a consequence: a peer left in the middle of a collective
            print(f"lockstep: worker {jax.process_index()}: a collective failed because a peer worker left "
                  f"({type(value).__name__}); exiting with code {code}.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return hook


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and those it was raised from or while handling (`__cause__`, `__context__`), in turn:
    a worker whose step failed as a peer left may then fail to read the step's donated arrays.

    >>> try:
    ...     try:
    ...         raise OSError("Gloo all-reduce failed")
    ...     finally:
    ...         raise RuntimeError("Array has been deleted")
    ... except RuntimeError as e:
    ...     [str(x) for x in _chain(e)]
    ['Array has been deleted', 'Gloo all-reduce failed']
    """
    out: list[BaseException] = []
    while error is not None and all(error is not seen for seen in out):
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


_INITIALIZED: list[ClusterResolver] = []
_AGREEMENT: list[ProgramAgreement] = []


def agree_on(what: str, values: Callable[[], dict[str, Any]]) -> None:
    """In a job of several workers, checks that every worker has the same `values()` at `what` (a
    point every worker reaches: a `fit`'s start); `WorkersDisagreeError` names the first that
    differs. Nothing to compare (nor compute) for one worker."""
    if _AGREEMENT:
        _AGREEMENT[0].check_values(what, values())


def any_worker(what: str, flags: dict[str, bool]) -> dict[str, bool]:
    """Each of `flags` true where it is true on any worker of the job (at `what`, a point every
    worker reaches): a decision that must be taken alike, from settings that may differ (a
    progress bar on worker 0 alone)."""
    if not _AGREEMENT:
        return flags
    every = _AGREEMENT[0].gather(what, flags)
    return {k: any(bool(f.get(k)) for f in every) for k in flags}


def _initialize(resolver: ClusterResolver, failure_timeout: float) -> None:
    if _INITIALIZED:
        prev = _INITIALIZED[0]
        if (prev.coordinator_address, prev.num_processes, prev.process_id) != (
                resolver.coordinator_address, resolver.num_processes, resolver.process_id):
            raise UsageError(f"jax.distributed is already initialised for {prev!r}; cannot join {resolver!r}.")
        return
    from ..engine import backends_started

    if backends_started():
        raise UsageError(
            "a multi-worker strategy (MultiWorkerMirroredStrategy, or a ShardedStrategy whose mesh spans the workers) "
            "must be created before any JAX computation (JAX has already started its backend): create the strategy "
            "first thing in the script, after `simulate_cpu_devices` if any.")
    timeout = max(1, int(round(_BACKSTOP * failure_timeout)))  # the watchdog (WATCHDOG x) fires first
    flag = f"--xla_cpu_collective_timeout_seconds={timeout}"
    if "xla_cpu_collective_timeout_seconds" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    devices = os.environ.get("LOCKSTEP_DEVICES_PER_PROC")
    if devices and jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", int(devices))
    # the address that reaches the other nodes, checked before any worker waits for another
    chosen = transport.choose(resolver.coordinator_address)
    join = float(os.environ.get("LOCKSTEP_JOIN_TIMEOUT", max(30.0, failure_timeout)))
    # lockstep's own deadline for every worker to join, well before the runtime's (which aborts with
    # a core dump and `DEADLINE_EXCEEDED ... RegisterTask`): a worker that never starts is named here
    late = threading.Timer(join, _not_joined, args=(resolver, join))
    late.daemon = True
    late.start()
    try:
        try:
            if resolver.process_id == 0:
                roll_call.host(resolver.coordinator_address, resolver.num_processes)
            else:
                roll_call.answer(resolver.coordinator_address, resolver.num_processes, resolver.process_id)
        except roll_call.PortBusyError as e:
            roll_call.second_worker_0(resolver.coordinator_address, resolver.num_processes)  # raises if so
            _cannot_start_coordinator(resolver, e.strerror or str(e))
        try:
            jax.distributed.initialize(resolver.coordinator_address, resolver.num_processes, resolver.process_id,
                                       initialization_timeout=int(2 * join + 30), heartbeat_timeout_seconds=timeout,
                                       shutdown_timeout_seconds=max(10, timeout))
        except Exception as e:
            if "Failed to start RPC server" in str(e):  # a half-started runtime can crash at exit: end here
                _cannot_start_coordinator(resolver, "the runtime failed to start its server")
            raise
    finally:
        late.cancel()
    transport.install(chosen)
    signals.install(resolver.process_id)  # SIGTERM / SIGINT end this worker (the runtime would ignore SIGTERM)
    _INITIALIZED.append(resolver)


def _cannot_start_coordinator(resolver: ClusterResolver, why: str) -> None:
    print(f"lockstep: worker {resolver.process_id}: could not start the coordinator at {resolver.coordinator_address} "
          f"({why}): its port is in use (or the address is not this machine's, or worker 0 was started twice and the "
          "first one's job has already started there); choose a free port in --coordinator / "
          "LOCKSTEP_COORDINATOR_ADDRESS; exiting with code 1.", file=sys.stderr, flush=True)
    os._exit(PORT_TAKEN_EXIT_CODE if os.environ.get("LOCKSTEP_COORDINATOR_CHOSEN") else 1)  # (the launcher's port: tried again)


def _not_joined(resolver: ClusterResolver, seconds: float) -> None:
    what = ("not every worker joined the coordinator" if resolver.process_id == 0
            else f"could not join the coordinator at {resolver.coordinator_address}")
    print(f"lockstep: worker {resolver.process_id}: {what} within {seconds:.0f} s ({resolver.num_processes} workers "
          "expected): check that every worker started, with the same --nnodes / --nproc-per-node and --coordinator "
          f"(or TF_CONFIG / SLURM settings); exiting with code {LOST_WORKER_EXIT_CODE}.", file=sys.stderr, flush=True)
    os._exit(LOST_WORKER_EXIT_CODE)


def join(cluster_resolver: ClusterResolver | None = None, failure_timeout: float | None = None
         ) -> tuple[ClusterResolver, float, ProgramAgreement | None]:
    """Joins this process to the job's other workers (once a process; a multi-worker strategy
    calls it before it looks at the devices): `cluster_resolver`, or the one the environment
    describes (LOCKSTEP_*, TF_CONFIG, SLURM); none is a job of one worker, this process.

    Returns:
      The cluster, the failure timeout (default `LOCKSTEP_FAILURE_TIMEOUT`, else 20 s), and the
      check the workers make before each new compiled program (None for one worker).
    """
    single = cluster_resolver is None and not cluster_configured(os.environ)
    # as TF: no cluster configured is a cluster of one worker (this process, its local devices)
    resolver = ClusterResolver(LOCAL, 1, 0) if single else (cluster_resolver or resolve_cluster())
    if not isinstance(resolver, ClusterResolver):
        raise TypeError(f"`cluster_resolver` must be a ClusterResolver, got {type(resolver).__name__}.")
    single = single or (resolver.num_processes == 1 and resolver.coordinator_address == LOCAL)
    if failure_timeout is None:
        failure_timeout = float(os.environ.get("LOCKSTEP_FAILURE_TIMEOUT", DEFAULT_FAILURE_TIMEOUT))
    if failure_timeout <= 0:
        raise ValueError(f"`failure_timeout` must be positive, got failure_timeout={failure_timeout!r}.")
    fresh = not _INITIALIZED
    if not single:
        _initialize(resolver, failure_timeout)
    if fresh and resolver.num_processes > 1:
        # the watchdog names a silent peer before the runtime's own heartbeat aborts this process
        _Watchdog(resolver.process_id, resolver.num_processes, _WATCHDOG * failure_timeout,
                  resolver.coordinator_address).start()
        sys.excepthook = _exit_at_once(sys.excepthook)
        _AGREEMENT.append(ProgramAgreement(resolver.process_id, resolver.num_processes, failure_timeout))
    # one numbering of new programs per process, whatever the number of strategies
    return resolver, failure_timeout, (_AGREEMENT[0] if _AGREEMENT else None)


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over every device of every worker process.

    Args:
      cluster_resolver: a `ClusterResolver`; `None` reads the LOCKSTEP_* variables, TF_CONFIG or SLURM,
        and with none of them set is one worker (this process), as in TF.
      communication_options: TF's `CommunicationOptions`: accepted; its `timeout_seconds` is the
        `failure_timeout` when that is not given (lockstep's collectives are XLA's whatever its
        `implementation` says).
      failure_timeout: seconds after which a dead or frozen worker ends the job (the runtime's
        heartbeat and collective time-outs, and lockstep's watchdog). Default:
        `LOCKSTEP_FAILURE_TIMEOUT`, else 20. Workers must all join within `LOCKSTEP_JOIN_TIMEOUT`
        seconds (default: the failure timeout, at least 30), else each exits with code 75 and a
        message saying which could not join.

    Every worker runs the same script. With NumPy inputs each worker keeps only the rows of its
    own replicas of each global batch; `distribute_datasets_from_function` gives each worker its
    own pipeline, and workers whose pipelines run out early contribute masked empty batches, so
    all take the same number of steps. Only the chief (worker 0) writes files.
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None, failure_timeout: float | None = None,
                 communication_options: Any = None):
        self.communication_options = checked_communication_options(communication_options)
        if failure_timeout is None and communication_options is not None:
            failure_timeout = communication_options.timeout_seconds  # TF's collective timeout
        self.cluster_resolver, self.failure_timeout, agreement = join(cluster_resolver, failure_timeout)
        super().__init__(jax.devices())
        if agreement is not None:
            self.extended.agree_on_programs(agreement)

    @property
    def num_workers(self) -> int:
        return self.cluster_resolver.num_workers

    @property
    def worker_index(self) -> int:
        return self.cluster_resolver.process_id
