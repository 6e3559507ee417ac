"""This rank's number and its group's size, as the Guard's parts read them: one object, not copies.

The Guard holds one :class:`~trainguard.guard.world.World` (a :class:`Ranks`) and gives it to every
part it builds (the checkpointer, the detectors, the replica check, the stop check, ...), which read
``rank``, ``world_size`` (and the straggler detector ``hosts``) from it when they need them. A
shrink or a growth in place (:mod:`trainguard.rejoin.shrink`) changes that one object, and every
part sees the new values at its next read. A part used on its own (a unit test, a benchmark) takes
a :class:`Ranks` of its own.
"""

from __future__ import annotations

from typing import Optional, Protocol


class RankView(Protocol):
    """What a part reads: this process's rank and the group's size (read-only to the part)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class HostsView(RankView, Protocol):
    """A :class:`RankView` with every rank's host name (index = rank)."""

    @property
    def hosts(self) -> list[str]: ...


class Ranks:
    """A rank, a world size and every rank's host (mutable: whoever holds it changes it for all its readers).

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: the number of ranks in the group (at least 1).
        hosts: every rank's host name (index = rank); default: none known (``[]``).

    Raises:
        ValueError: ``world_size < 1`` or ``rank`` outside ``[0, world_size)``.
    """

    def __init__(self, rank: int, world_size: int, hosts: Optional[list[str]] = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}: expected world_size >= 1 and 0 <= rank < it")
        self.rank, self.world_size = rank, world_size
        self.hosts: list[str] = list(hosts) if hosts is not None else []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"
