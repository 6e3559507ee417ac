"""The Guard's side of in-process recovery: where a lost peer is caught in the Guard's own calls
(:meth:`Recovering.recoverable`), and what the Guard does around a meeting that
:class:`~.inprocess.InProcess` carries out (its place handed over and taken back, the liveness
ping, a save in flight, the state of the replica check and of a step re-run)."""

from __future__ import annotations

import time
from typing import Callable, Optional

from ..health.straggler import StragglerDetector
from ..instability.recovery import Recovery
from ..rejoin.forward import RollForward
from ..rejoin.rank import Rejoin
from ..stop.signals import ShutdownHandler
from .context import Context
from .inprocess import InProcess, Met, Place
from .saving import Commits
from .sdc_response import SDCResponse
from .stop_check import StopCheck


class Caught:
    """``with Caught(rejoin, where, step) as lost:`` (:meth:`Recovering.recoverable`): an error of
    the block that is a lost peer (:meth:`Rejoin.caught` records it) ends the block; ``lost`` is
    then true. Any other error propagates. (A class, not a ``contextlib`` generator: the Guard
    enters one a few times per step.)"""

    __slots__ = ("rejoin", "where", "step", "lost")

    def __init__(self, rejoin: Rejoin, where: str, step: int):
        self.rejoin, self.where, self.step, self.lost = rejoin, where, step, False

    def __enter__(self) -> Caught:
        return self

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], tb: object) -> bool:
        if isinstance(error, Exception) and self.rejoin.caught(error, self.where, self.step):
            self.lost = True
            return True  # recorded: the block ends here
        return False

    def __bool__(self) -> bool:
        return self.lost


class Recovering:
    """A lost peer caught in the Guard's calls, and the recoveries that follow.

    Args:
        ctx: the Guard's :class:`~.context.Context` (the world: its step, rank, world size, hosts
            and ping are taken from a meeting; the hang supervisor's sections; ``redo_in_step``: a
            framework's loop, whose peer lost after the update is recovered at the next step's
            ``recover_in_step``).
        inprocess: carries out the meetings (and holds this rank's recovery state, ``inprocess.rejoin``).
        stop_check, straggler: their next check and report steps travel with the place.
        commits: finishes a save in flight before a meeting.
        recovery: the instability recovery (a replacement starts its statistics again).
        response: the replica check and step re-runs, forgotten at a meeting (a replacement knows
            of neither).
        shutdown: its deadline timer (armed by a failed ping) is cancelled after a recovery.
    """

    def __init__(
        self,
        ctx: Context,
        inprocess: InProcess,
        stop_check: StopCheck,
        straggler: StragglerDetector,
        commits: Commits,
        recovery: Recovery,
        response: SDCResponse,
        shutdown: ShutdownHandler,
    ):
        self.world, self.rejoin, self.inprocess = ctx.world, inprocess.rejoin, inprocess
        self.stop_check, self.straggler, self.commits = stop_check, straggler, commits
        self.recovery, self.sdc, self.reruns, self.shutdown = recovery, response.check, response.reruns, shutdown
        self.section, self.redo_in_step = ctx.section, ctx.script.redo_in_step
        self.arm_at_step = False  # a replacement catches the script's collectives from its first step
        # [recovery] roll_forward where it applies (the Guard's build sets it: trainguard.rejoin.forward)
        self.forward: Optional[RollForward] = None
        # a survivor whose peers stopped elsewhere in the step: it meets at the step's end (recover)
        self.deferred = False

    def recoverable(self, where: str, step: Optional[int] = None) -> Caught:
        """``with recovering.recoverable("checkpointing") as lost: ...``: a lost peer in the block
        under in-process recovery is recorded at ``where`` and step ``step`` (default: the
        completed steps) and ends the block; ``lost`` is then true (:class:`Caught`)."""
        return Caught(self.rejoin, where, self.world.step if step is None else step)

    def place(self) -> Place:
        """Where this rank stands, for a meeting."""
        w = self.world
        return Place(
            w.step,
            w.rank,
            w.world_size,
            tuple(w.hosts),
            self.stop_check.next_check,
            self.straggler.next_report,
            self.stop_check.step_seconds,
        )

    def take(self, met: Met) -> None:
        """Take the place and the liveness ping a recovery, growth or join ended with."""
        p, w = met.place, self.world
        w.step, w.rank, w.world_size = p.step, p.rank, p.world_size
        self.stop_check.next_check = p.next_check
        w.hosts = list(p.hosts)
        self.straggler.next_report = p.next_report
        w.ping = met.ping

    def recover(self, redo: bool, take_completed: bool = True) -> None:
        """A peer was lost in this step: stop the ping and finish a save in flight (it fails on its
        broken group; nothing commits), then meet the new generation (:meth:`InProcess.recover`).
        ``redo``: the update of this step was not applied (the caller does not count the step);
        ``take_completed``: as :meth:`InProcess.recover`.

        Raises:
            as :meth:`InProcess.recover` (this rank exits and the launcher restarts the group).
        """
        self.deferred = False
        with self.section("recovery"):
            self.inprocess.started(self.place())
            self._meeting(lambda: self.inprocess.recover(self.place(), redo, take_completed))

    def roll_forward(self, passes: int) -> None:
        """A peer was lost in this step's gradient buckets and the backward pass is over (called by
        :class:`~trainguard.rejoin.forward.RollForward`, from the autograd engine, inside the
        script's ``loss.backward()``; ``passes``: the step's passes so far), or in the buffers'
        broadcast of its first forward (``passes`` = -1, from the forward's pre-hook): stop the
        ping, finish a save in flight, meet the replacement there (:meth:`InProcess.roll_forward`);
        the loop goes on inside its step.

        Raises:
            as :meth:`InProcess.roll_forward` (out of ``loss.backward()``: this rank exits and the
                launcher restarts the group).
        """
        if self.deferred:  # a later pass of the step: it meets at the step's end
            return
        with self.section("recovery"):
            if not self.inprocess.rolls_forward_with_all(self.place(), passes):
                self.deferred = True  # the step goes on alone; after_update/step_end meets (recover)
                return
            self._meeting(lambda: self.inprocess.roll_forward(self.place(), self.forward, passes))

    def _meeting(self, meet: Callable[[], Met]) -> None:
        """Around a survivor's meeting: the old group's ping abandoned, a save in flight finished;
        the place it ends with taken; the step re-run and replica check forgotten."""
        if self.world.ping is not None:  # its group lost the peer too
            self.world.ping.abandon()
            self.world.ping = None
        self.commits.wait()
        self.take(meet())
        self.reruns.forget()  # a replacement knows of no re-run in progress
        self.sdc.forget()  # nor of a replica check stashed at the step before
        self.shutdown.deadline_timer.cancel()  # armed by the ping's failure

    def after_update(self) -> None:
        """A peer was lost after this step's update was applied: the step is complete; recover now
        (the next step starts on the new group), or, for a framework's loop (``redo_in_step``),
        at the next step's ``recover_in_step`` (its first step is then done again)."""
        if not self.redo_in_step:
            self.recover(redo=False)

    def grow(self, number: int) -> None:
        """The ranks agreed to grow back in place into generation ``number`` (:meth:`InProcess.grow`)."""
        with self.section("recovery"):
            self.world.stop_ping()  # a collective on the old group, at the same point on every rank
            self.commits.wait()
            self.take(self.inprocess.grow(number, self.place()))
            self.sdc.forget()  # the newcomers stashed no replica check

    def join(self) -> float:
        """A replacement of a lost rank (or a newcomer) starts here instead of resuming
        (:meth:`InProcess.join`); returns ``time.perf_counter()`` at its end (the step timer's start)."""
        t0 = time.monotonic()
        met = self.inprocess.join(self.place())
        self.take(met)
        if met.ahead:  # the survivors rolled the step forward: they wait at its backward pass's end
            self.forward.ahead = met.ahead
            self.inprocess.resume_hook(met.hook)  # its detectors' values ride in the survivors' bucket
        else:  # the script's collectives before its first step (a framework's set-up after this) complete alone
            self.arm_at_step = True
        self.recovery.rejoined()
        self.inprocess.keep_boundary(self.world.step)
        self.inprocess.joined(met, time.monotonic() - t0)
        return time.perf_counter()

    def met_pass(self, last: bool, at_forward: bool) -> None:
        """A replacement all-reduced a backward pass of its first step again with survivors that
        rolled it forward (``last``: it has met them; ``at_forward``: in its first forward's
        broadcast of the buffers instead): :meth:`InProcess.met_pass`."""
        self.inprocess.met_pass(last, lambda: self.world.step + 1, at_forward)

    def step_begin(self, step: int) -> None:
        """Step ``step`` begins (the Guard's component protocol): :meth:`catch_peers`."""
        self.catch_peers()

    def catch_peers(self) -> None:
        """A replacement catches lost peers in the script's collectives from now on (once)."""
        if self.arm_at_step:
            self.arm_at_step = False
            self.inprocess.arm_catch(lambda: self.world.step + 1)
