"""The progress rule of in-process recovery: the first completed step after a meeting (or after a new
start of the group) tells the launcher (:meth:`~trainguard.rejoin.protocol.RecoveryStore.stepped`),
and a survivor's recovery is finished then (its ``recovery_finished`` event and console line).

A component of :class:`~trainguard.guard.Guard`: :class:`~.inprocess.InProcess` tells it where a
meeting left the rank (:meth:`Progress.settle`, :meth:`Progress.met`), the start tells it where
training begins (:meth:`Progress.began`), and the Guard's ``step_end`` tells it of each completed
step (:meth:`Progress.step_completed`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from .. import console
from ..events import EventLog
from ..rejoin.align import Alignment
from ..rejoin.loop_check import LoopCheck
from ..rejoin.protocol import Generation
from ..rejoin.rank import Rejoin
from ..rejoin.stepstart import StepStart
from .place import Met


@dataclass(frozen=True)
class Unsettled:
    """A survivor's recovery that met its generation and awaits its first completed step (the
    progress rule): what its ``recovery_finished`` event and console line then say.

    Attributes:
        gen: the generation met.
        boundary: the step boundary of the meeting (completed steps).
        steps_lost: completed steps trained again (a sharded model's rollback; else 0).
        redo_step: the interrupted step done again (1-based), ``None`` if none.
        at: ``time.time()`` of the fault (the failure caught on this rank).
        said: what the lowest survivor prints once the step completes (``""``: nothing).
    """

    gen: Generation
    boundary: int
    steps_lost: int
    redo_step: Optional[int]
    at: float
    said: str = ""


class Progress:
    """Which generation's first completed step this rank has not yet told the launcher of, and a
    survivor's recovery that awaits it (one per rank).

    Args:
        rejoin: this rank's recovery state (its store, generation and failure).
        optimizer: the script's optimizer (the loop check after a meeting compares its hyperparameters).
        model: the script's model: a DDP model's parameters and optimizer state are compared too.
        step_start: the optimizer/scheduler state at the step's start (``None``: inactive; its
            scheduler is the one the loop check reads).
        events: the event log (``recovery_finished``).
    """

    def __init__(
        self,
        rejoin: Rejoin,
        optimizer: Optional[torch.optim.Optimizer],
        step_start: Optional[StepStart],
        events: EventLog,
        model: Optional[torch.nn.Module],
        align: Alignment,
    ):
        self.rejoin, self.optimizer, self.step_start, self.events = rejoin, optimizer, step_start, events
        self.align = align  # the Guard's alignment of the collectives after a meeting (rejoin.align)
        self.model = model  # a DDP model's replicas are compared after a meeting (loop_check.replica_state)
        # the generation this rank met and whose first completed step it has not told the launcher of
        # (the progress rule), with the step boundary of the meeting; a survivor's finish to say then
        self._stepping: Optional[tuple[int, int]] = None
        self._unsettled: Optional[Unsettled] = None

    def met(self, number: int, step: int) -> None:
        """This rank met generation ``number`` at step boundary ``step`` (a growth, a replacement or
        newcomer that joined): its first completed step tells the launcher."""
        self._stepping = (number, step)

    def settle(
        self, gen: Generation, met: Met, steps_lost: int, redo_step: Optional[int], said: str, align: bool = True
    ) -> None:
        """A survivor met ``gen``: the recovery is finished once the group completes a step with it
        (:meth:`step_completed`); the lowest survivor names its first collective from now on
        (:mod:`~trainguard.rejoin.align`). ``steps_lost``: completed steps trained again;
        ``redo_step``: the step done again, ``None`` if none; ``said``: the console's words then;
        ``align``: the survivors' next collective is named for a replacement to line up with
        (``False``: a step rolled forward, where the ranks meet at a backward pass's end)."""
        lowest = min(set(range(met.place.world_size)) - set(gen.replaced))
        self._stepping = (gen.number, met.place.step)
        self._unsettled = Unsettled(
            gen, met.place.step, steps_lost, redo_step, self.rejoin.failure.at, said if met.place.rank == lowest else ""
        )
        if gen.replaced and align:
            self.align.survivor(
                self.rejoin.store, gen.number, met.place.step, lowest=met.place.rank == lowest, rank=met.place.rank
            )
        self.rejoin.done()

    def began(self, step: int) -> None:
        """A rank of a new start of the group begins training at step boundary ``step``: its first
        completed step tells the launcher too (before it, a lost rank restarts the group: no rank
        holds a state to send yet)."""
        if self.rejoin.active:
            self._stepping = (self.rejoin.generation, step)

    def step_completed(self, step: int, rank: int, world_size: int) -> None:
        """Completed step ``step`` ended on this rank (the Guard's ``step_end``; ``rank`` and
        ``world_size`` as now). The first one after a meeting tells the launcher (the progress
        rule: :meth:`~trainguard.rejoin.protocol.RecoveryStore.stepped`), and a survivor's recovery
        is finished: its ``recovery_finished`` event (``seconds`` from the fault to this step) and
        the lowest survivor's console line. Nothing otherwise (two attribute reads).

        Raises:
            AlignmentError: a replacement's first step ended while the survivors wait at a
                collective it did not reach (:meth:`~trainguard.rejoin.align.Alignment.step_end`).
            LoopDiverged: after a meeting, the ranks' optimizer hyperparameters differ
                (:mod:`~trainguard.rejoin.loop_check`).
        """
        if self.align.active:
            self.align.step_end(step)
        if self._stepping is None or step <= self._stepping[1]:
            return
        number, _ = self._stepping
        self._stepping = None
        verified: list[str] = []
        if number > 0:  # after a meeting: do the ranks' loops and replicas still agree? (not at a new start)
            scheduler = self.step_start.scheduler if self.step_start is not None else None
            check = LoopCheck(self.rejoin.store, self.optimizer, scheduler, self.model)
            check.check(number, rank, world_size, step)
            verified = check.verified
        self.rejoin.store.stepped(number)
        u, self._unsettled = self._unsettled, None
        if u is None:
            return
        seconds = time.time() - u.at
        self.events.emit(
            "recovery_finished",
            u.boundary,
            rank=rank,
            generation=u.gen.number,
            replaced=list(u.gen.replaced),
            left=list(u.gen.left),
            world_size=world_size,
            seconds=round(seconds, 4),
            first_step=step,
            steps_lost=u.steps_lost,
            redo_step=u.redo_step,
            verified=verified,
        )
        if u.said:
            checked = (
                f"every rank's {', '.join(verified)} found alike after it"
                if verified
                else "nothing compared across the ranks after it (not a DDP model, or a rank not heard from)"
            )
            console.say(
                f"recovered in-process: step {step} completed on the new group {seconds:.2f} s after the fault; "
                f"{u.said}; {checked}"
            )
