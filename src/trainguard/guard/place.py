"""Where a rank stands in its group (:class:`Place`) and where a recovery, a growth or a join left it
(:class:`Met`): the values the Guard and its in-process recovery
(:class:`~trainguard.guard.inprocess.InProcess`, :class:`~trainguard.guard.sharded_recovery.ShardedRecovery`)
hand each other. A module of its own, so that those two need not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..health import LivenessPing
from ..rejoin.protocol import Generation


@dataclass(frozen=True)
class Place:
    """Where a rank stands in its group: what in-process recovery can change.

    Attributes:
        step: completed steps (``guard.step``).
        rank, world_size: this process's rank and the group's size.
        hosts: the host of each rank (``world_size`` names).
        next_check: the step of the next stop check (agreed by all ranks).
        next_report: the step of the next straggler report.
        step_seconds: the rank's step time (seconds, the stop check's decaying mean; 0: unknown).
    """

    step: int
    rank: int
    world_size: int
    hosts: tuple[str, ...]
    next_check: int
    next_report: int
    step_seconds: float = 0.0


@dataclass(frozen=True)
class Met:
    """The outcome of a recovery, a growth or a join: the rank's new :class:`Place`, the liveness
    ping started on the new group (``None``: no ping), the generation, and whether the abandoned
    step is done again (``redo``: the Guard's ``steps()`` yields it again); a replacement: the
    backward passes of its first step it all-reduces again with survivors that rolled the step
    forward (``ahead``, :mod:`~trainguard.rejoin.forward`; 0: none), and where their DDP hook stood
    as that step began (``hook``, :meth:`~trainguard.rejoin.catch.DDPHook.progress`)."""

    place: Place
    ping: Optional[LivenessPing]
    gen: Generation
    redo: bool = False
    ahead: int = 0
    hook: tuple[int, int] = (0, 0)
