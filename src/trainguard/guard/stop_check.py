"""The stop check: every rank's stop flags agreed at the same step boundary, about once a second.

At a check step every rank packs its :class:`~trainguard.stop.conditions.StopFlags` (signal, kill
switch, time limit, memory, save switch, the next check step it proposes, rank 0's pending growth)
and, on a straggler report step, its step timings; the ranks agree on their maximum. With DDP or
FSDP2 these values ride in a collective the step already runs (a gradient bucket, or
``clip_grad_norm_``'s all-reduce: :mod:`trainguard.instability.fold`), so the check costs no
collective of its own; otherwise (a plain module, a fault injected into the check) it is one
all-reduce. Every rank then decides alike: the next check step (``[stop] check_seconds`` turned
into steps from the measured step time, or ``[stop] check_interval``), a stop, a growth.

What a decision leads to (a save, a stop, a growth in place) is the Guard's
(:meth:`trainguard.guard.guard.Guard.step_end`); this module only agrees on the flags.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from .. import dist as tgdist
from ..checkpoint.checkpointer import Checkpointer
from ..faults import FaultInjector
from ..health.straggler import StragglerDetector
from ..instability.fold import LossFold
from ..ranks import RankView
from ..stop.conditions import StopConditions, StopFlags

# the decay of the remembered step time per step: a slow step counts for the time limit for a while
# (0.98: about 35 steps to halve it)
STEP_SECONDS_DECAY = 0.98


class StopCheck:
    """When the stop flags are next exchanged, and the exchange (one rank's view; every rank holds
    the same :attr:`next_check`).

    Args:
        stop: this rank's stop conditions (the flags and the proposed check interval).
        ckpt: the checkpointer (its estimated save seconds: a time limit leaves room for the save).
        straggler: the straggler detector (its timings ride with the flags on report steps).
        fold: the values that ride in the step's collective (:meth:`LossFold.stop_flags`,
            :meth:`LossFold.straggler`: ``None`` when they did not ride this step).
        faults: the fault injector (a fault injected into the stop check needs its own all-reduce).
        growth_pending: ``() -> int``: on rank 0 with ``[elastic] min_ranks``, the generation a
            spare or node may grow into in place (0: none); ``None`` when growth is off.
        world: this process's rank, read at each check (:class:`~trainguard.ranks.RankView`: the
            Guard's shared :class:`~.world.World`, which a shrink or growth changes).

    Attributes:
        next_check: the step number at which the flags are next exchanged (agreed by all ranks;
            0 before the first check: the first step boundary checks).
        step_seconds: the step time the time limit and the check interval go by (seconds): the
            longest recent step, decaying by :data:`STEP_SECONDS_DECAY` a step.
    """

    def __init__(
        self,
        stop: StopConditions,
        ckpt: Checkpointer,
        straggler: StragglerDetector,
        fold: LossFold,
        faults: FaultInjector,
        growth_pending: Optional[Callable[[], int]],
        world: RankView,
    ):
        self.stop, self.ckpt, self.straggler, self.fold, self.faults = stop, ckpt, straggler, fold, faults
        self.growth_pending, self.world = growth_pending, world
        self.next_check = 0
        self.step_seconds = 0.0

    def step_took(self, seconds: float) -> None:
        """A step ended after ``seconds``: remembered as :attr:`step_seconds` while it is the longest."""
        self.step_seconds = max(seconds, STEP_SECONDS_DECAY * self.step_seconds)

    def due(self, step: int) -> bool:
        """Whether the flags are exchanged at the end of step number ``step``."""
        return step >= self.next_check

    def folds(self, step: int) -> bool:
        """Whether the check at the end of step number ``step`` is due and rides in its collective."""
        return self.due(step) and not self.faults.due_at(step, "stop_check")

    def flags_to_fold(self, step: int) -> Optional[list[int]]:
        """This rank's packed stop flags for the check at the end of step number ``step``, to ride in
        the step's collective, or ``None`` where the check is not due then or needs its own
        all-reduce. (Called from the DDP hook, in the backward.)"""
        return self.local_flags(step).pack() if self.folds(step) else None

    def straggler_to_fold(self, step: int) -> Optional[list[int]]:
        """This rank's straggler timings for a report at the end of step number ``step``, to ride
        beside the stop flags, or ``None`` where no report is due then. (From the DDP hook.)"""
        return self.straggler.pack(step) if self.folds(step) and self.straggler.due(step) else None

    def local_flags(self, step: int) -> StopFlags:
        """This rank's stop flags at step ``step`` (with rank 0's pending growth)."""
        ahead = self.stop.next_interval(self.step_seconds)
        mine = self.stop.local_flags(self.step_seconds, self.ckpt.estimated_save_seconds(), ahead, step)
        if self.world.rank == 0 and self.growth_pending is not None:  # a spare (regrow) or a node may join in place
            mine = dataclasses.replace(mine, grow=self.growth_pending())
        return mine

    def agree(self, step: int) -> tuple[StopFlags, list[int]]:
        """The flags every rank agreed on at the end of step number ``step`` (their maximum) and,
        on a straggler report step, the ranks found slow (else ``[]``). Reads them from the step's
        collective where every rank's rode in it, else runs one all-reduce (a collective). Sets
        :attr:`next_check` to the agreed next check step.

        Raises:
            the all-reduce's error: a peer was lost in it (the caller's in-process recovery decides).
        """
        report = self.straggler.due(step)
        agreed = self.fold.stop_flags(step)  # carried in the step's collective, if every rank's was
        if agreed is not None and report:
            timings = self.fold.straggler(step)
            agreed = None if timings is None else agreed + timings
        if agreed is None:
            mine = self.local_flags(step).pack()
            agreed = tgdist.all_reduce_max(mine + (self.straggler.pack(step) if report else []))
        flags = StopFlags.unpack(agreed)
        self.next_check = step + flags.next_interval
        slow = self.straggler.unpack(step, agreed[StopFlags.size() :]) if report else []
        return flags, slow
