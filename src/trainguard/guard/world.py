"""Where one rank stands, shared by the Guard and its components: one object, not copies.

Every part the Guard builds holds the :class:`World` (a :class:`~trainguard.ranks.Ranks`: the
parts outside :mod:`trainguard.guard` read it through :class:`~trainguard.ranks.RankView`) and
reads ``rank``, ``world_size``, ``hosts`` and ``step`` from it when it needs them. When the group
changes in place (a shrink or a growth, :mod:`trainguard.rejoin.shrink`) :class:`Renumber`
changes the world once, then tells the few parts that hold something sized for the old group
(``group_resized()``) to drop it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from ..events import EventLog
from ..ranks import Ranks
from ..rejoin import shrink


class World(Ranks):
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
        super().__init__(rank, world_size)
        self.step = 0
        self.rolled_back = False
        self.ping: Any = None

    def stop_ping(self) -> None:
        """Stop and close the liveness ping (a collective on its group: on every rank at the same point)."""
        if self.ping is not None:
            self.ping.stop()
            self.ping.close()
            self.ping = None


class Resized(Protocol):
    """A part that holds something sized or agreed for the group: ``group_resized()`` drops it
    after the shared world changed size (the part reads the new rank and size from the world)."""

    def group_resized(self) -> None: ...


class Renumber:
    """``renumber(rank, world_size, hosts)``: this process is rank ``rank`` of ``world_size`` from
    now on (:class:`~.inprocess.InProcess` calls it before the new group forms): the world changes
    once (every part reads it), then the event log, the sampler's shard and the parts sized for the
    old group are told.

    Args:
        world: the shared view.
        events: the event log (events carry the new rank).
        resized: the parts that hold something sized or agreed for the old group
            (``group_resized()``: the fold, the replica check, the straggler detector, the
            micro-batcher's gradient buckets).
        sampler: the script's sampler (``reshard(rank, world_size)``), or ``None``.
    """

    def __init__(
        self,
        world: World,
        events: EventLog,
        resized: tuple[Resized, ...],
        sampler: Optional[Any],
    ):
        self.world, self.events, self.resized, self.sampler = world, events, resized, sampler

    def __call__(self, rank: int, world_size: int, hosts: list[str]) -> None:
        self.world.rank, self.world.world_size, self.world.hosts = rank, world_size, list(hosts)
        self.events.renumber(rank)
        for part in self.resized:
            part.group_resized()
        shrink.reshard(self.sampler, rank, world_size)
