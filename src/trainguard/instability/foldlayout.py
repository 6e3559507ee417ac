"""The wire format of the fold's values (:mod:`.fold`): which slot of the carried float32 vector
holds what, declared once.

The vector is :data:`FIELDS` laid end to end. A field of one value per rank has ``world_size``
slots (rank ``r``'s first), one of a fixed count has that many. Each rank writes only its own
slots and its one-value flags (``1`` where set), zeros elsewhere, so the all-reduce's sum gives
every rank's values exactly, and each flag's sum counts the ranks that set it. For ``n`` ranks::

    loss[n] noted matched stop_sent stop_flags[5] grow next_interval[n]
    fingerprint_sent fingerprint[3n] straggler_sent straggler[3n]          (8n + 11 values)

:class:`FoldLayout` gives each field's slots as a ``slice`` (or one index), the only way
:class:`~.fold.LossFold` reads and writes them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Field:
    """One field of the fold's vector.

    Attributes:
        name: the field's name (:meth:`FoldLayout.slot`).
        width: its values (per rank, if ``per_rank``).
        per_rank: one ``width``-value part per rank, rank 0's first; else ``width`` values in all.
        meaning: what the values are (the sum over the ranks, for a value not per rank).
    """

    name: str
    width: int
    per_rank: bool
    meaning: str


FIELDS: tuple[Field, ...] = (
    Field("loss", 1, True, "each rank's loss (the 0-dim tensor its backward() ran on)"),
    Field("noted", 1, False, "ranks that noted a loss this step"),
    Field("matched", 1, False, "ranks whose should_step() loss was their backward's, the step before"),
    Field("stop_sent", 1, False, "ranks that sent their stop flags (StopFlags.pack())"),
    Field("stop_flags", 5, False, "signal, kill switch, time limit, memory, save switch: ranks that set each"),
    Field("grow", 1, False, "rank 0's grow flag (the others send 0)"),
    Field("next_interval", 1, True, "each rank's proposed next stop-check interval, in steps"),
    Field("fingerprint_sent", 1, False, "ranks that sent a replica fingerprint"),
    Field("fingerprint", 3, True, "each rank's 64-bit parameter fingerprint, in 3 chunks below 2**24"),
    Field("straggler_sent", 1, False, "ranks that sent straggler timings"),
    Field("straggler", 3, True, "each rank's slowest step (µs), window median (µs), score × 10**4"),
)


@dataclass(frozen=True)
class FoldLayout:
    """Where each field of :data:`FIELDS` lies in the fold's vector for ``world_size`` ranks.

    Attributes:
        world_size: the ranks (slots of each per-rank field).
        size: the vector's length, ``8 × world_size + 11``.
        starts: each field's first slot, by name.
    """

    world_size: int
    size: int
    starts: dict[str, int]

    @staticmethod
    @functools.cache
    def of(world_size: int) -> FoldLayout:
        """The layout for ``world_size`` ranks (one object per size).

        Raises:
            ValueError: ``world_size`` is below 1.
        """
        if world_size < 1:
            raise ValueError(f"a fold's world size must be at least 1, got {world_size}")
        starts, at = {}, 0
        for f in FIELDS:
            starts[f.name] = at
            at += f.width * (world_size if f.per_rank else 1)
        return FoldLayout(world_size, at, starts)

    def slot(self, name: str, rank: Optional[int] = None) -> slice:
        """The slots of field ``name``: all of them, or (``rank``, for a per-rank field) that
        rank's part.

        Raises:
            KeyError: no such field.
            ValueError: ``rank`` given for a field not per rank, or out of ``[0, world_size)``.
        """
        f = _FIELD[name]
        start = self.starts[name]
        if rank is None:
            return slice(start, start + f.width * (self.world_size if f.per_rank else 1))
        if not f.per_rank or not 0 <= rank < self.world_size:
            raise ValueError(f"field {name!r} has no part for rank {rank} (world size {self.world_size})")
        return slice(start + f.width * rank, start + f.width * (rank + 1))

    def index(self, name: str, rank: Optional[int] = None) -> int:
        """The one slot of a one-value field (``rank``'s, for a per-rank one).

        Raises:
            ValueError: the field (or rank's part) holds more than one value.
        """
        s = self.slot(name, rank)
        if s.stop - s.start != 1:
            raise ValueError(f"field {name!r} holds {s.stop - s.start} values: use slot()")
        return s.start


_FIELD = {f.name: f for f in FIELDS}
