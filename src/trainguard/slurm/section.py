"""The ``[slurm]`` config section."""

from __future__ import annotations

from pydantic import Field

from ..sections import Section


class SlurmSection(Section):
    """``[slurm]``: behaviour when the run is a SLURM job."""

    auto_requeue: bool = Field(False, description="on a requeue-worthy exit (75) the launcher runs 'scontrol requeue' for its own job, once")
