"""Where a job's workers are: `ClusterResolver` (coordinator address, number of workers, this one's
index) and its readers of the environment: LOCKSTEP_* variables (`lockstep launch`), TF_CONFIG, SLURM.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any


#: the "coordinator" of a job of one process that joins no cluster
LOCAL = "127.0.0.1:0"


class ClusterResolver:
    """Where the coordinator is, how many workers there are, and which one this is.

    >>> r = ClusterResolver("127.0.0.1:29500", num_processes=2, process_id=1)
    >>> r.task_type, r.task_id, r.is_chief, r.num_workers
    ('worker', 1, False, 2)
    """

    #: what TF calls this task's type ("chief" or "worker"); None in a job of one process without a cluster
    task_type: str | None = "worker"

    def __init__(self, coordinator_address: str, num_processes: int, process_id: int):
        if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
            raise ValueError(f"`coordinator_address` must be 'host:port', got {coordinator_address!r}.")
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"`num_processes` must be a positive integer, got num_processes={num_processes!r}.")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ValueError(f"`process_id` must be in [0, {num_processes}), got process_id={process_id!r}.")
        self.coordinator_address = coordinator_address
        self.num_processes = num_processes
        self.process_id = process_id

    @property
    def task_id(self) -> int | None:
        """The task's index among the tasks of its `task_type`, as TF numbers them (the worker's
        index, unless TF_CONFIG names a chief); `process_id` is its place in the whole job."""
        return self.process_id

    @property
    def num_workers(self) -> int:
        return self.num_processes

    @property
    def is_chief(self) -> bool:
        """Worker 0 writes files and prints."""
        return self.process_id == 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(coordinator_address={self.coordinator_address!r}, "
                f"num_processes={self.num_processes}, process_id={self.process_id})")


def _int_env(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"the environment variable {name} must be an integer, got {env[name]!r}.") from None


class EnvClusterResolver(ClusterResolver):
    """From `LOCKSTEP_COORDINATOR_ADDRESS`, `LOCKSTEP_NUM_PROCESSES`, `LOCKSTEP_PROCESS_ID`."""

    def __init__(self, env: dict[str, str] | None = None):
        env = dict(os.environ if env is None else env)
        missing = [k for k in ("LOCKSTEP_COORDINATOR_ADDRESS", "LOCKSTEP_NUM_PROCESSES", "LOCKSTEP_PROCESS_ID")
                   if k not in env]
        if missing:
            raise ValueError(f"the environment lacks {missing} for a multi-worker cluster.")
        super().__init__(env["LOCKSTEP_COORDINATOR_ADDRESS"], _int_env(env, "LOCKSTEP_NUM_PROCESSES"),
                         _int_env(env, "LOCKSTEP_PROCESS_ID"))


class ClusterSpec:
    """TF's `tf.train.ClusterSpec` as multi-worker code reads it: `as_dict()`, `jobs`, `num_tasks`.

    >>> ClusterSpec({"worker": ["a:1", "b:1"]}).num_tasks("worker")
    2
    """

    def __init__(self, cluster: dict[str, list[str]]):
        self._cluster = {job: list(tasks) for job, tasks in cluster.items()}

    def as_dict(self) -> dict[str, list[str]]:
        return {job: list(tasks) for job, tasks in self._cluster.items()}

    @property
    def jobs(self) -> list[str]:
        return list(self._cluster)

    def num_tasks(self, job_name: str) -> int:
        return len(self._cluster.get(job_name, []))


class TFConfigClusterResolver(ClusterResolver):
    """From `TF_CONFIG`, as `tf.distribute` users already write it.

    The chief (if the cluster names one) is worker 0 and the coordinator; else ``worker[0]`` is.
    `task_type` and `task_id` are TF_CONFIG's (``worker`` 0 is process 1 where a chief is listed).
    Without TF_CONFIG, as in TF, the cluster is this process alone, whose `task_type` and
    `task_id` are None.

    >>> import json
    >>> cfg = {"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "task": {"type": "worker", "index": 1}}
    >>> r = TFConfigClusterResolver(json.dumps(cfg))
    >>> r.coordinator_address, r.num_processes, r.task_type, r.task_id, r.process_id
    ('c:1', 3, 'worker', 1, 2)
    >>> r = TFConfigClusterResolver({})
    >>> r.num_workers, r.task_type, r.task_id, r.is_chief
    (1, None, None, True)
    """

    def __init__(self, tf_config: str | dict[str, Any] | None = None):
        raw = os.environ.get("TF_CONFIG") if tf_config is None else tf_config
        if raw is None or (isinstance(raw, str) and not raw.strip()) or raw == {}:
            super().__init__(LOCAL, 1, 0)  # as TF: no TF_CONFIG is an empty cluster, this process alone
            self.task_type, self._index = None, None
            return
        try:
            cfg = json.loads(raw) if isinstance(raw, str) else raw
            cluster, task = cfg["cluster"], cfg["task"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"TF_CONFIG must be JSON with 'cluster' and 'task', got {raw!r}.") from None
        chief = list(cluster.get("chief", []))
        workers = chief + list(cluster.get("worker", []))
        if not workers:
            raise ValueError(f"TF_CONFIG's cluster lists no 'chief' or 'worker', got {cluster!r}.")
        kind, index = task.get("type"), task.get("index", 0)
        index = int(index) if isinstance(index, str) and index.isdigit() else index  # "1", as TF takes it
        if kind not in ("chief", "worker"):
            raise ValueError(f"TF_CONFIG's task type must be 'chief' or 'worker', got {kind!r}.")
        size = len(chief) if kind == "chief" else len(workers) - len(chief)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
            raise ValueError(f"TF_CONFIG's task index must be an integer in [0, {size}) (the cluster lists {size} "
                             f"{kind!r} task{'s' if size != 1 else ''}), got {index!r}.")
        pid = index if kind == "chief" else len(chief) + index
        super().__init__(workers[0], len(workers), pid)
        self.task_type, self._index, self._cluster = kind, index, dict(cluster)

    def cluster_spec(self) -> "ClusterSpec":
        """TF_CONFIG's cluster (empty without TF_CONFIG), as TF's `ClusterSpec` shows it."""
        return ClusterSpec(getattr(self, "_cluster", {}))

    @property
    def task_id(self) -> int | None:
        return self._index


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``node[03-05,09],gpu1``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}.")
    prefix, ranges = m.group(1), m.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


class SlurmClusterResolver(ClusterResolver):
    """From SLURM's variables: `SLURM_NTASKS`, `SLURM_PROCID` and the first node of the job's
    node list; the port is `LOCKSTEP_COORDINATOR_PORT` (default 29500).

    >>> env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    >>> SlurmClusterResolver(env).coordinator_address
    'gpu07:29500'
    """

    def __init__(self, env: dict[str, str] | None = None):
        env = dict(os.environ if env is None else env)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if "SLURM_NTASKS" not in env or "SLURM_PROCID" not in env or not nodelist:
            raise ValueError("SLURM_NTASKS, SLURM_PROCID and SLURM_JOB_NODELIST are needed for a SLURM cluster.")
        port = env.get("LOCKSTEP_COORDINATOR_PORT", "29500")
        super().__init__(f"{_first_slurm_host(nodelist)}:{port}", _int_env(env, "SLURM_NTASKS"),
                         _int_env(env, "SLURM_PROCID"))


def cluster_configured(env: Any) -> bool:
    return "LOCKSTEP_COORDINATOR_ADDRESS" in env or "TF_CONFIG" in env or (
        "SLURM_NTASKS" in env and "SLURM_PROCID" in env)


def resolve_cluster(env: dict[str, str] | None = None) -> ClusterResolver:
    """The cluster this process belongs to: LOCKSTEP_* variables, else TF_CONFIG, else SLURM.

    Raises:
      ValueError: none of them is set (the message says what to set).
    """
    env = dict(os.environ if env is None else env)
    if "LOCKSTEP_COORDINATOR_ADDRESS" in env:
        return EnvClusterResolver(env)
    if "TF_CONFIG" in env:
        return TFConfigClusterResolver(env["TF_CONFIG"])
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        return SlurmClusterResolver(env)
    raise ValueError(
        "no cluster found: start the workers with `lockstep launch`, or set LOCKSTEP_COORDINATOR_ADDRESS, "
        "LOCKSTEP_NUM_PROCESSES and LOCKSTEP_PROCESS_ID (or TF_CONFIG, or run under SLURM), or pass a "
        "ClusterResolver."
    )
