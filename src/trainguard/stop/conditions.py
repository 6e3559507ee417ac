"""Stop and save conditions checked at step boundaries: signal, kill switch, time limit (``[stop]
max_duration`` or the SLURM job's end time), memory watchdog, save switch.

Each rank computes its local flags; the Guard combines them across ranks in one small all-reduce
(max), so every rank takes the same decision at the same step and none is left waiting in a save.
With a DDP model they ride in one of the check step's gradient buckets instead
(:mod:`trainguard.instability.fold`), computed when the step's backward starts.
"""

from __future__ import annotations

import math
import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Optional

from ..config import StopSection
from ..launch_env import LaunchEnv
from ..slurm.endtime import JobEndTime
from .memory import MemoryWatchdog
from .signals import ShutdownHandler


@dataclass(frozen=True)
class StopFlags:
    """One rank's stop and save flags, or (after the all-reduce with max) the ranks' agreement.

    The fields travel as a vector of ints in this order (:meth:`pack` / :meth:`unpack`); the stop
    reasons come first, in priority order (a signal wins, then the kill switch, the time limit, the
    memory watchdog). ``next_interval`` is the steps until the next check this rank proposes: the
    maximum over ranks is taken, so every rank schedules the next check at the same step without
    another collective. ``grow`` is not a stop reason: the number of a generation in which the group
    grows back in place (rank 0 finds it published, :meth:`~trainguard.rejoin.rank.Rejoin.growth_pending`;
    0: none), so every rank meets the newcomers after the same step.
    """

    signal: int = 0
    kill_switch: int = 0
    time_limit: int = 0
    memory: int = 0
    save_switch: int = 0
    next_interval: int = 1
    grow: int = 0

    REASONS = ("signal", "kill_switch", "time_limit", "memory")

    @classmethod
    def size(cls) -> int:
        """Length of the packed vector."""
        return len(fields(cls))

    def pack(self) -> list[int]:
        """The fields as ints, in declaration order."""
        return [int(v) for v in astuple(self)]

    @classmethod
    def unpack(cls, values: list[int]) -> StopFlags:
        """The inverse of :meth:`pack` (extra trailing values are not read)."""
        return cls(*values[: cls.size()])

    @property
    def reason(self) -> Optional[str]:
        """The stop reason (``None`` = keep training)."""
        return next((name for name in self.REASONS if getattr(self, name)), None)


def launch_start_time(launch: Optional[LaunchEnv] = None) -> float:
    """Unix time the launch began: the launcher's (:attr:`~trainguard.launch_env.LaunchEnv.launch_time`
    of ``launch``, default read from the environment now), else now.

    Restarted worker groups of one launch share it, so the time limit counts the whole launch.

    Raises:
        LaunchEnvError: the launcher's value is not a number.
    """
    launched = (launch or LaunchEnv.from_environ()).launch_time
    return time.time() if launched is None else launched


class StopConditions:
    """Evaluates this rank's stop/save flags.

    Args:
        cfg: the ``[stop]`` section.
        run_dir: switch files are relative to it.
        shutdown: the signal recorder.
        memory: the ``[memory]`` watchdog, or ``None``.
        start_time: Unix time the launch began (for ``max_duration``).
        end_time: Unix time by which the ranks must have exited; default: the SLURM job's end
            as ``trainguard run`` passes it (:class:`~trainguard.slurm.endtime.JobEndTime`: the
            job's EndTime minus ``[slurm] end_margin``, kept current when the time limit changes).
    """

    def __init__(
        self,
        cfg: StopSection,
        run_dir: Path,
        shutdown: ShutdownHandler,
        memory: Optional[MemoryWatchdog] = None,
        start_time: Optional[float] = None,
        end_time: Optional[float] = None,
    ):
        self.cfg = cfg
        self.memory = memory
        self.kill_path = run_dir / cfg.kill_switch
        self.save_path = run_dir / cfg.save_switch
        self.shutdown = shutdown
        self.start_time = launch_start_time() if start_time is None else start_time
        self._job_end = JobEndTime() if end_time is None else None
        self._fixed_end = end_time

    def kill_switch(self) -> bool:
        """True when the kill-switch file exists."""
        return self.kill_path.exists()

    @property
    def end_time(self) -> Optional[float]:
        """Unix time by which the ranks must have exited (``None``: no such limit)."""
        return self._fixed_end if self._job_end is None else self._job_end.get()

    def time_left(self) -> Optional[float]:
        """Seconds until the time limit: the earlier of ``start_time + [stop] max_duration`` and the
        job's end time (``None`` when neither is set). Negative once it has passed."""
        limits = [
            t
            for t in (None if self.cfg.max_duration is None else self.start_time + self.cfg.max_duration, self.end_time)
            if t is not None
        ]
        return min(limits) - time.time() if limits else None

    def next_interval(self, step_seconds: float) -> int:
        """Steps until the next check this rank proposes: ``[stop] check_interval`` if set, else
        ``ceil(check_seconds / step_seconds)`` clamped to [1, 1000] (auto)."""
        if self.cfg.check_interval:
            return self.cfg.check_interval
        if step_seconds <= 0:
            return 1
        return max(1, min(1000, math.ceil(self.cfg.check_seconds / step_seconds)))

    def local_flags(self, step_seconds: float, save_seconds: float, steps_ahead: int = 1, step: int = 0) -> StopFlags:
        """This rank's flags.

        Args:
            step_seconds: estimate of one more step (the slowest recent step).
            save_seconds: estimate of one save (the last measured save, or a size-based guess).
            steps_ahead: steps until the next check (the time limit must hold until then).
            step: the current step (the memory watchdog measures every ``check_interval`` steps).
        The time limit fires when fewer than ``(steps_ahead + 1) × step + save + time_margin``
        seconds remain. ``next_interval`` is :meth:`next_interval`.
        """
        left = self.time_left()
        late = left is not None and left < (steps_ahead + 1) * step_seconds + save_seconds + self.cfg.time_margin
        return StopFlags(
            signal=int(self.shutdown.received is not None),
            kill_switch=int(self.kill_switch()),
            time_limit=int(late),
            memory=int(self.memory is not None and self.memory.over(step)),
            save_switch=int(self.save_path.exists()),
            next_interval=self.next_interval(step_seconds),
        )

    def clear_save_switch(self) -> None:
        """Remove the save-switch file (after the requested save)."""
        try:
            self.save_path.unlink()
        except FileNotFoundError:
            pass
