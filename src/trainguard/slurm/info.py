"""What SLURM says about the job this process runs in: :class:`SLURMInfo`.

Built from the job's environment (``SLURM_JOB_ID``, ``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID``,
``SLURM_JOB_NODELIST``, ``SLURM_NODEID``, ``SLURM_RESTART_COUNT``, ...) plus one
``scontrol show job -o <id>`` for what the environment does not hold: the time limit, the end
time, the job state and whether the job may be requeued.

Times: ``time_limit`` is in seconds, ``end_time`` and ``start_time`` are Unix times (seconds).
SLURM prints times in the local time zone of the machine running ``scontrol``; they are read the
same way here.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Mapping, Optional

SCONTROL_TIMEOUT = 30.0  # seconds; slurmctld answers in milliseconds unless it is down or overloaded
_KEY = re.compile(r"^[A-Za-z][\w:/.]*=")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class SlurmError(RuntimeError):
    """A SLURM command failed or could not be run (the message names the command and its error)."""


def parse_slurm_time(text: str) -> Optional[float]:
    """Seconds in a SLURM time-limit string, as ``sbatch --time`` and ``scontrol`` write them.

    Accepted: ``minutes``, ``minutes:seconds``, ``hours:minutes:seconds``, ``days-hours``,
    ``days-hours:minutes``, ``days-hours:minutes:seconds``; ``UNLIMITED``/``INFINITE`` give ``None``.

    Raises:
        ValueError: any other text (the message shows the accepted forms).
    """
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(value)
    if not m:
        raise ValueError(
            f"time {text!r} is not a SLURM time: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
        )
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (nums + [0, 0])[:3]
        return float(int(days) * 86400 + hours * 3600 + minutes * 60 + seconds)
    if len(nums) == 1:
        return float(nums[0] * 60)
    if len(nums) == 2:
        return float(nums[0] * 60 + nums[1])
    return float(nums[0] * 3600 + nums[1] * 60 + nums[2])


def parse_slurm_timestamp(text: Optional[str]) -> Optional[float]:
    """Unix time of a SLURM timestamp such as ``2026-11-23T06:54:32`` (local time); ``None`` for
    ``Unknown``, ``None``, ``N/A`` or anything else that is not a timestamp."""
    if not text:
        return None
    try:
        return datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_show_job(text: str) -> dict[str, str]:
    """``{key: value}`` of ``scontrol show job -o`` output (one job, one line).

    A value holding spaces (a command line, a comment) keeps them: a word that does not start a
    ``Key=`` belongs to the previous value.
    """
    fields: dict[str, str] = {}
    last: Optional[str] = None
    for word in text.strip().split(" "):
        if _KEY.match(word):
            key, _, value = word.partition("=")
            fields[key] = value
            last = key
        elif last is not None and word:
            fields[last] += " " + word
    return fields


def show_job(job_id: str, scontrol: str = "scontrol", timeout: float = SCONTROL_TIMEOUT) -> dict[str, str]:
    """``scontrol show job -o JOB_ID`` as a dict (see :func:`parse_show_job`).

    Raises:
        SlurmError: ``scontrol`` is missing, timed out (``timeout`` seconds), failed, or printed nothing.
    """
    cmd = [scontrol, "show", "job", "-o", str(job_id)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{' '.join(cmd)}: {e}") from None
    if proc.returncode != 0 or not proc.stdout.strip():
        msg = " ".join((proc.stderr or proc.stdout).split()) or "no output"
        raise SlurmError(f"{' '.join(cmd)} exited with {proc.returncode}: {msg}")
    return parse_show_job(proc.stdout.splitlines()[0])


@dataclass
class SLURMInfo:
    """The SLURM job this process runs in.

    Attributes:
        job_id: ``SLURM_JOB_ID`` (for an array task, the task's own job id).
        array_job_id, array_task_id: ``SLURM_ARRAY_JOB_ID`` / ``SLURM_ARRAY_TASK_ID`` (``None``
            outside job arrays).
        node_list: ``SLURM_JOB_NODELIST`` in SLURM's compressed form (``node[01-04]``).
        num_nodes: ``SLURM_JOB_NUM_NODES``.
        node_id: ``SLURM_NODEID``: this node's index in the job (0 on the first node).
        restart_count: ``SLURM_RESTART_COUNT``: how often the job was requeued (0 at first).
        job_name, partition: ``SLURM_JOB_NAME`` / ``SLURM_JOB_PARTITION``.
        time_limit: the job's time limit in seconds (``None`` when unlimited or unknown).
        start_time, end_time: Unix times from ``scontrol`` (``None`` when unknown).
        job_state: ``JobState`` from ``scontrol`` (``RUNNING``, ``COMPLETING``, ...).
        requeue_allowed: ``Requeue=1`` in ``scontrol`` (``None`` when unknown).
        query_error: why ``scontrol`` could not be asked (``None`` when it answered or was not asked).
    """

    job_id: str
    array_job_id: Optional[str] = None
    array_task_id: Optional[str] = None
    node_list: str = ""
    num_nodes: int = 1
    node_id: int = 0
    restart_count: int = 0
    job_name: str = ""
    partition: str = ""
    time_limit: Optional[float] = None
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    job_state: Optional[str] = None
    requeue_allowed: Optional[bool] = None
    query_error: Optional[str] = None

    @property
    def requeue_id(self) -> str:
        """The id ``scontrol requeue`` needs: ``ARRAYJOB_TASK`` for an array task, else the job id."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @classmethod
    def from_env(
        cls, env: Optional[Mapping[str, str]] = None, query: bool = True, scontrol: str = "scontrol"
    ) -> Optional[SLURMInfo]:
        """The job of ``env`` (default ``os.environ``), or ``None`` when ``SLURM_JOB_ID`` is unset.

        With ``query``, ``scontrol show job`` fills in the time limit, end time and state; when it
        fails those stay ``None`` and ``query_error`` says why (no exception).
        """
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        info = cls(
            job_id=job_id,
            array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=env.get("SLURM_ARRAY_TASK_ID") or None,
            node_list=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""),
            num_nodes=_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"), 1),
            node_id=_int(env.get("SLURM_NODEID"), 0),
            restart_count=_int(env.get("SLURM_RESTART_COUNT"), 0),
            job_name=env.get("SLURM_JOB_NAME", ""),
            partition=env.get("SLURM_JOB_PARTITION", ""),
        )
        if query:
            info.refresh(scontrol)
        return info

    def refresh(self, scontrol: str = "scontrol") -> None:
        """Read the time limit, start/end time, state and requeue flag from ``scontrol show job``;
        on failure set ``query_error`` and leave the fields as they were."""
        try:
            job = show_job(self.job_id, scontrol)
        except SlurmError as e:
            self.query_error = str(e)
            return
        self.query_error = None
        self.job_state = job.get("JobState")
        try:
            self.time_limit = parse_slurm_time(job.get("TimeLimit", "UNLIMITED"))
        except ValueError:  # Partition_Limit, NOT_SET, ...
            self.time_limit = None
        self.start_time = parse_slurm_timestamp(job.get("StartTime"))
        self.end_time = parse_slurm_timestamp(job.get("EndTime"))
        if "Requeue" in job:
            self.requeue_allowed = job["Requeue"] == "1"
        if "Restarts" in job and job["Restarts"].isdigit():
            # the controller's count: the same as SLURM_RESTART_COUNT for a batch job's own steps
            self.restart_count = max(self.restart_count, int(job["Restarts"]))

    def to_event(self) -> dict:
        """The fields as a JSON-ready dict, plus ``requeue_id``."""
        return {**asdict(self), "requeue_id": self.requeue_id}


def _int(text: Optional[str], default: int) -> int:
    try:
        return int(text) if text not in (None, "") else default
    except ValueError:
        return default
