"""Stop and save: the Guard's checkpoints (:class:`Commits` acts on a finished save,
:class:`StopAndSave` saves, stops, and runs the stop check at a step boundary).

A save is a collective (every rank calls it at the same step); a stop saves first and raises
:class:`~trainguard.outcomes.Requeue` (exit code 75), so the launcher relaunches and the run
resumes from that checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from .. import console
from ..checkpoint.checkpointer import Checkpointer, SaveResult
from ..checkpoint.store import Checkpoint
from ..health.straggler import StragglerDetector
from ..instability.recovery import Recovery
from ..outcomes import Requeue
from ..rejoin.align import STOP_CHECK, Alignment
from ..state.trainstate import TrainState
from ..stop.conditions import StopConditions, StopFlags
from ..stop.signals import ShutdownHandler
from .context import Context
from .stop_check import StopCheck

# Rank 0 writes a `progress` event (step, recent step time) at a stop check at most this often (seconds);
# reports draw the run's timeline from these, the checkpoints and the incidents.
PROGRESS_SECONDS = 10.0


class Commits:
    """What follows a finished save: a committed checkpoint awaits its known-good verdict (rank 0),
    retention runs (never the newest known-good), the hooks hear of it, rank 0 says so (an
    interval's checkpoint at most every ``console.CHECKPOINT_LINE_SECONDS``).

    Args:
        ctx: the Guard's :class:`~.context.Context` (rank, step; the script's hooks hear
            ``on_checkpoint_save``).
        ckpt: the checkpointer.
        recovery: the instability recovery (known-good verdicts, protected checkpoints).
    """

    def __init__(self, ctx: Context, ckpt: Checkpointer, recovery: Recovery):
        self.ctx, self.world, self.ckpt, self.recovery = ctx, ctx.world, ckpt, recovery
        self._last_line = -console.CHECKPOINT_LINE_SECONDS  # monotonic time of the last checkpoint line

    def saved(self, r: Optional[SaveResult]) -> None:
        """Act on a finished save ``r`` (``None``, or one that committed nothing: nothing)."""
        if r is None or r.checkpoint is None:
            return
        protect: set[int] = set()
        if self.world.rank == 0:
            if r.reason != "interval" or time.monotonic() - self._last_line >= console.CHECKPOINT_LINE_SECONDS:
                self._last_line = time.monotonic()
                console.say(f"checkpoint at step {r.step} committed ({r.reason}): {r.checkpoint.path}")
            self.recovery.on_commit(r.checkpoint)
            self.recovery.after_step(
                self.world.step
            )  # a background commit may land after the steps that make it known-good
            protect = self.recovery.protected()
        self.ckpt.retain(r, protect)
        self.ctx.tell_hooks("on_checkpoint_save", r.step, r.checkpoint.path)

    def wait(self) -> None:
        """Finish a save in flight and act on it (the same result on every rank from here on)."""
        self.saved(self.ckpt.wait())


class StopAndSave:
    """Saves, stops, and the stop check at a step boundary.

    Args:
        ctx: the Guard's :class:`~.context.Context` (``[stop]``, ``[memory]``, ``[straggler]``,
            ``[run] dir``; the event log; injected faults at ``checkpointing`` and ``stop_check``;
            the hang supervisor's sections).
        commits: what follows a save (and its checkpointer, ``commits.ckpt``).
        stop_check: the agreed stop check (:class:`~.stop_check.StopCheck`).
        stop: the stop conditions (their details for the ``stop_requested`` event).
        shutdown: the signal handler (the signal received).
        straggler: writes the exclude list of a stop for stragglers.
        recovering: a lost peer in a save or a check (:class:`~.recovering.Recovering`); its
            ``grow`` when the ranks agreed to grow back.
        train_state: what a checkpoint holds per rank besides the tensors (``guard.rank_state()``).
        align: the Guard's alignment of a replacement's collectives with the survivors' (the stop
            check is one of trainguard's collectives it names).
    """

    def __init__(
        self,
        ctx: Context,
        commits: Commits,
        stop_check: StopCheck,
        stop: StopConditions,
        shutdown: ShutdownHandler,
        straggler: StragglerDetector,
        recovering: Any,
        train_state: TrainState,
        align: Alignment,
    ):
        self.cfg, self.world, self.events, self.faults, self.section = (
            ctx.cfg,
            ctx.world,
            ctx.events,
            ctx.faults,
            ctx.section,
        )
        self.ckpt, self.commits, self.stop_check, self.stop, self.shutdown = (
            commits.ckpt,
            commits,
            stop_check,
            stop,
            shutdown,
        )
        self.straggler, self.recovering, self.train_state, self.align = straggler, recovering, train_state, align
        self._last_progress = time.monotonic()

    def rank_state(self) -> dict[str, Any]:
        """This rank's non-tensor training state: ``{"step": ..., **train_state}``."""
        return {"step": self.world.step, **self.train_state.state_dict()}

    def save(
        self, reason: str, tiers: tuple[str, ...] = ("persistent",), blocking: bool = True
    ) -> Optional[Checkpoint]:
        """A checkpoint of the current step (``guard.save``; a collective). ``None``: not blocking,
        nothing new committed, or a peer was lost in it (recovered: the next interval saves)."""
        step = self.world.step
        with self.section("checkpointing"):
            if self.faults.pending:
                self.faults.at(step, "checkpointing")
            self.commits.wait()  # the previous save's result: the same on every rank from here on
            self.ckpt.check_failures(step)
            with self.recoverable(
                "checkpointing"
            ) as lost:  # nothing was committed: the commit follows the last collective
                result = self.ckpt.save(step, reason, tiers, self.rank_state(), blocking)
            if lost:
                self.recovering.after_update()  # the step is complete; the next interval saves
                return None
            self.commits.saved(result)
        return result.checkpoint if result is not None else None

    def recoverable(self, where: str) -> Any:
        return self.recovering.recoverable(where)

    def stop_now(self, reason: str, **extra: Any) -> None:
        """Stop for ``reason``: the ``stop_requested`` event, rank 0's line, a save (a replica check
        still pending is settled first by the caller: :meth:`.sdc_flow.SDCFlow.stop`).

        Raises:
            Requeue: always (after the checkpoint).
        """
        details: dict[str, Any] = {"reason": reason, **extra}
        if reason == "signal":
            details.update(signal=self.shutdown.received, signal_time=self.shutdown.received_at)
        elif reason == "time_limit":
            details.update(
                time_left=self.stop.time_left(), max_duration=self.cfg.stop.max_duration, end_time=self.stop.end_time
            )
        elif reason == "memory":
            details.update(limits=self.cfg.memory.model_dump(exclude_none=True))
        step = self.world.step
        if self.world.rank == 0:
            self.events.emit("stop_requested", step, **details)
            why = f"{reason} {details['signal']}" if reason == "signal" else reason
            console.say(f"stop requested at step {step} ({why}): saving, then exit 75 to be relaunched")
        self.save(reason)
        raise Requeue(reason, f"stopped at step {self.world.step} ({reason}), checkpoint saved: relaunch to resume")

    def check(self, stop: Callable[..., None]) -> Optional[StopFlags]:
        """The stop check (:meth:`StopCheck.agree`) and what follows from it: the progress event, a
        stop for stragglers; returns the agreed flags, or ``None`` when the group changed in place
        at this boundary (a lost peer replaced, or grown back): its newcomers start after it, so
        the rest of it (a save, the save switch) waits for the next. ``stop(reason, **details)``:
        how a stop is carried out (:meth:`.sdc_flow.SDCFlow.stop`).

        Raises:
            Requeue: a stop for stragglers (``[straggler] stop_if_detected``).
        """
        step = self.world.step
        if self.faults.pending:
            self.faults.at(step, "stop_check")
        if self.align.open:  # after an in-process recovery: does this rank line up with the survivors?
            self.align.at(STOP_CHECK, alone_ok=False)
        with self.recoverable("stop_check") as lost:
            flags, slow = self.stop_check.agree(step)
        if lost:
            self.recovering.after_update()  # the step is complete: check again at the next one
            return None
        if self.world.rank == 0 and time.monotonic() - self._last_progress >= PROGRESS_SECONDS:
            self._last_progress = time.monotonic()
            self.events.emit("progress", step, step_seconds=round(self.stop_check.step_seconds, 6))
        if slow and self.cfg.straggler.stop_if_detected:
            if self.world.rank == 0:
                self.straggler.write_exclude(slow)
            exclude = str(Path(self.cfg.run.dir) / "exclude_nodes")
            stop("straggler", ranks=slow, hosts=self.straggler.hosts_of(slow), exclude_nodes=exclude)
        if flags.grow and flags.reason is None:  # a stop wins: that generation is left to form
            self.recovering.grow(flags.grow)
            return None
        return flags
