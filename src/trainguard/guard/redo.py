"""A step done again on a survivor after an in-process recovery (DDP or a plain module): the parts
that make it the interrupted attempt once more, built, armed and given back together.

- the redo check (:mod:`~trainguard.rejoin.redo_check`): the step done again must take the
  interrupted attempt's batch, or the recovery fails (said in the recovery store: the launcher
  restarts the group);
- the batch replay (:mod:`~trainguard.rejoin.replay`): the loop's data loader iterators give the
  batch(es) of the interrupted attempt back;
- the generators' redo start (:mod:`~trainguard.rejoin.gapdraws`): the random numbers drawn
  before the step's first forward, and a replacement's share of them.

A component of :class:`~.inprocess.InProcess`, which builds it only where a step can be done
again in place: recovery on, a step start kept, and no sharded model (that one rolls back to
its snapshots instead).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import console
from ..events import EventLog
from ..rejoin import regroup
from ..rejoin.gapdraws import GapDraws
from ..rejoin.protocol import Generation
from ..rejoin.rank import Rejoin
from ..rejoin.redo_check import RedoCheck
from ..rejoin.replay import BatchReplay
from ..rejoin.stepstart import StepStart, schedulers_not_kept
from ..state.trainstate import TrainState
from .place import Place


class StepRedo:
    """The parts of a step done again on one rank (see the module's doc).

    Args:
        model: the script's model (the redo check and the generators' redo start hook its forward).
        optimizer: the script's optimizer (its schedulers not given to the Guard are said).
        train_state: the Guard's named parts; its ``rng`` part, when there is one, is what the
            generators' redo start reads and sets.
        step_start: the optimizer/scheduler state at the step's start (the redo check and the
            generators' redo start are armed with it).
        rejoin: this rank's recovery state (its rank, store and generation, for what is said).
        events: the event log (``resume_not_bitwise``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        train_state: TrainState,
        step_start: StepStart,
        rejoin: Rejoin,
        events: EventLog,
    ):
        self.optimizer, self.step_start, self.rejoin, self.events = optimizer, step_start, rejoin, events
        self.check: Optional[RedoCheck] = RedoCheck(model, self._differs)
        step_start.also(self.check)
        self.replay: Optional[BatchReplay] = BatchReplay()
        if not self.replay.install():  # torch's iterator class is not where compat.py expects it
            self.replay = None
        self.gap: Optional[GapDraws] = None
        if "rng" in train_state.parts:
            self.gap = GapDraws(model, train_state.parts["rng"], self._not_repeated)
            step_start.also(self.gap)

    def step_ended(self) -> None:
        """``guard.step_end`` begins (:meth:`.replay.BatchReplay.step_ended`)."""
        if self.replay is not None:
            self.replay.step_ended()

    def begin(self, place: Place, gen: Generation) -> None:
        """The survivor is back at the interrupted step's start (its boundary state and step start
        restored), meeting ``gen``: say the schedulers that the step done again steps twice; with
        fewer ranks (a shrink) each takes another share of the data, so the redo check has nothing
        to compare."""
        self._say_stray_schedulers(place, gen)
        if gen.left and self.check is not None:
            self.check.forget()

    def forget(self) -> None:
        """The next step is a new one, not this one done again (the rank took the completed step
        from a peer): nothing to compare, no draws to take."""
        for part in (self.check, self.gap):
            if part is not None:
                part.forget()

    def arm(self) -> int:
        """The loop yields the step again and fetches its batch again: its data loaders give the
        interrupted attempt's batch(es) back. Returns how many they will give (0: none kept)."""
        return self.replay.arm() if self.replay is not None else 0

    def close(self) -> None:
        """Give back what the parts installed (the forward hooks, torch's ``__next__``); safe twice."""
        for part in (self.check, self.replay, self.gap):
            if part is not None:
                part.close()
        self.check, self.replay, self.gap = None, None, None

    def _not_repeated(self, cause: str) -> None:
        """A replacement's first step cannot repeat the lost rank's draws (:mod:`~trainguard.rejoin.gapdraws`)."""
        self.events.emit("resume_not_bitwise", self.rejoin.boundary.step, rank=self.rejoin.rank, cause=cause)
        console.warn(f"a resume cannot be bitwise identical: {cause}")

    def _differs(self, why: str) -> None:
        """The step done again got another batch (:class:`~trainguard.rejoin.redo_check.RedoCheck`):
        the recovery fails; the launcher restarts the group (said here and in the recovery store).

        Raises:
            RegroupError: always.
        """
        reason = f"rank {self.rejoin.rank}: {why}"
        console.say(f"in-process recovery failed: {reason}")
        try:
            self.rejoin.store.give_up(self.rejoin.generation, reason)
        except Exception as e:  # the launcher's store may be gone: the exit says enough
            console.warn(f"could not tell the launcher why ({e})")
        raise regroup.RegroupError(reason)

    def _say_stray_schedulers(self, place: Place, gen: Generation) -> None:
        """A step done again steps the schedulers the Guard was not given twice: say so
        (``resume_not_bitwise`` and a console line from the lowest surviving rank)."""
        stray = schedulers_not_kept(self.optimizer, self.step_start.kept())
        if not stray:
            return
        cause = (
            f"the optimizer's scheduler(s) {', '.join(stray)} were not given to the Guard (scheduler=): the step done "
            "again steps them twice, and a checkpoint does not hold their state"
        )
        self.events.emit("resume_not_bitwise", place.step, rank=place.rank, cause=cause)
        if place.rank == min(set(range(place.world_size)) - set(gen.replaced)):
            console.warn(f"a resume cannot be bitwise identical: {cause}")
