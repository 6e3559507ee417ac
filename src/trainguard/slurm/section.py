"""The ``[slurm]`` config section.

Two groups of keys: what ``trainguard run`` does when it runs inside a SLURM job (``auto_requeue``,
``use_end_time``, ``end_margin``), and the defaults of the batch script that
``trainguard slurm script|submit`` writes (each can be overridden on the command line).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator

from ..sections import Section


class SlurmSection(Section):
    """``[slurm]``: behaviour when the run is a SLURM job, and the sbatch script's defaults."""

    # ---- inside a job (trainguard run) ----
    auto_requeue: bool = Field(
        False,
        description="on a requeue-worthy exit (75: signal, time limit, memory, straggler; not the kill switch) the launcher on the job's first node runs 'scontrol requeue' for its own job (ARRAYJOB_TASK for an array task), once per job and restart",
    )
    use_end_time: bool = Field(
        True,
        description="stop before the job's EndTime (from 'scontrol show job'): the ranks' time limit is the earlier of [stop] max_duration and EndTime - end_margin",
    )
    end_margin: float = Field(
        20.0,
        ge=0,
        description="seconds before the job's EndTime that the ranks must have saved and exited by, so that the launcher can exit and requeue before SLURM kills the job",
    )
    end_time_refresh: float = Field(
        60.0,
        ge=0,
        description="seconds between re-reads of the job's EndTime by the first node's launcher ('scontrol show job'), so that a changed time limit (scontrol update TimeLimit=...) reaches the ranks; 0 = read once at start",
    )

    # ---- the batch script (trainguard slurm script|submit) ----
    partition: Optional[str] = Field(None, description="sbatch --partition (default: the cluster's default partition)")
    time: Optional[str] = Field(
        None, description="sbatch --time: minutes, HH:MM:SS or D-HH:MM:SS (default: the partition's limit)"
    )
    signal_lead: Optional[float] = Field(
        None,
        ge=0,
        description="seconds before the time limit that SLURM sends SIGUSR1 to the batch shell (--signal=B:USR1@N; 0 = no --signal); default: from the run's measured step and save times",
    )
    job_name: Optional[str] = Field(None, description="sbatch --job-name (default: the run directory's name)")
    gres: Optional[str] = Field(None, description="sbatch --gres, e.g. 'gpu:8'")
    cpus_per_task: Optional[int] = Field(
        None, ge=1, description="sbatch --cpus-per-task (one task per node: the node's trainguard run)"
    )
    rdzv_port: int = Field(
        29500, ge=1, le=65535, description="port of the c10d rendezvous on the job's first node (several nodes only)"
    )
    sbatch_args: list[str] = Field(
        [], description="more sbatch options written as '#SBATCH' lines, e.g. ['--account=proj', '--qos=high']"
    )

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: Any) -> Any:
        if v is None or v == "":
            return None
        from .info import parse_slurm_time

        parse_slurm_time(str(v))  # ValueError → a config error naming slurm.time
        return str(v)
