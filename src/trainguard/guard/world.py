"""Where one rank stands, shared by the Guard and its components: one object, not copies.

The Guard's components that it built for itself (:mod:`.recovering`, :mod:`.saving`,
:mod:`.sdc_flow`, :mod:`.rollback`, :mod:`.lifecycle`, :mod:`.boundary`, :mod:`.resume`,
:mod:`.sdc_response`) hold the :class:`World` and read ``rank``, ``world_size``,
``hosts`` and ``step`` from it when they need them. The parts built from their own config sections
(the checkpointer, the detectors, the replica check, ...) take their rank and world size as
numbers; :class:`Renumber` tells every one of them at once when the group changes in place (a
shrink or a growth, :mod:`trainguard.rejoin.shrink`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from ..events import EventLog
from ..health.straggler import StragglerDetector
from ..rejoin import shrink


class World:
    """This rank's place in the group and in training (mutable; one per Guard).

    Attributes:
        rank, world_size: this process's rank and the group's size (a shrink or growth changes them).
        hosts: every rank's host (index = rank), gathered at the start (empty before).
        step: completed steps (``guard.step``).
        rolled_back: the step in progress was undone (a rollback, a lost peer before its update,
            a step done again for silent data corruption): the next ``step_end`` does not count it.
        ping: the liveness ping of the current group (:mod:`trainguard.health`), ``None`` before
            the start and after it was stopped.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.hosts: list[str] = []
        self.step = 0
        self.rolled_back = False
        self.ping: Any = None

    def stop_ping(self) -> None:
        """Stop and close the liveness ping (a collective on its group: on every rank at the same point)."""
        if self.ping is not None:
            self.ping.stop()
            self.ping.close()
            self.ping = None


class Numbered(Protocol):
    def renumber(self, rank: int, world_size: int) -> None: ...


class Renumber:
    """``renumber(rank, world_size, hosts)``: this process is rank ``rank`` of ``world_size`` from
    now on (:class:`~.inprocess.InProcess` calls it before the new group forms): the world, the
    event log, the sampler's shard and every part given here are told at once.

    Args:
        world: the shared view.
        events: the event log (events carry the new rank).
        parts: the parts that keep ``rank`` and ``world_size`` (``renumber(rank, world_size)``).
        straggler: the straggler detector (it keeps the hosts too).
        sized: the parts that keep the world size only (``renumber(world_size)``: the
            resume-fidelity record, the bucket layout).
        sampler: the script's sampler (``reshard(rank, world_size)``), or ``None``.
    """

    def __init__(
        self,
        world: World,
        events: EventLog,
        parts: tuple[Numbered, ...],
        straggler: StragglerDetector,
        sized: tuple[Any, ...],
        sampler: Optional[Any],
    ):
        self.world, self.events, self.parts = world, events, parts
        self.straggler, self.sized, self.sampler = straggler, sized, sampler

    def __call__(self, rank: int, world_size: int, hosts: list[str]) -> None:
        self.events.renumber(rank)
        for part in self.parts:
            part.renumber(rank, world_size)
        self.straggler.renumber(rank, world_size, hosts)
        for part in self.sized:
            part.renumber(world_size)
        shrink.reshard(self.sampler, rank, world_size)
        self.world.rank, self.world.world_size, self.world.hosts = rank, world_size, list(hosts)
