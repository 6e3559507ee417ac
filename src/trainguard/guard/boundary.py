"""The step's points (:class:`Boundary`): its opening, the update's check (``should_step``), and
its close, the step boundary (``step_end``), as the Guard's public methods call them.

At the boundary, on every rank: the step is counted and timed (unless it was undone: a rollback,
a lost peer before its update, a step done again), this rank's state is kept for in-process
recovery, a sharded model's snapshot is taken, the hang supervisor hears of the step, the hooks
are told, the replica check is settled; then the stop check (about once a second, every rank
alike) and the saves it or the checkpoint interval asks for (docs/guard.md, "The step boundary").
"""

from __future__ import annotations

import time
from typing import Any, Optional

from .. import health
from ..instability.recovery import Rollback
from ..state.fidelity import DRAWN_AFTER_RESUME, DRAWN_BETWEEN_STEPS
from ..stop.conditions import StopFlags
from .context import Context


class Boundary:
    """Where a step opens, is checked before its update, and closes.

    Args:
        ctx: the Guard's :class:`~.context.Context` (the world: the step counter, rank, hosts, the
            liveness ping; the model: injected faults, the re-run's check; the hooks, told
            ``on_step_end``; the injected faults).
        parts: the Guard's :class:`~.parts.Parts` (read when called: the heartbeat record is
            dropped at close); their component protocol's ``step_begin``, ``should_step`` and
            ``step_end`` run at this step's points.

    Attributes:
        last_loss: the last counted step's loss, as given (``guard.last_loss``).
        awaiting: a step was opened and not closed yet.
    """

    def __init__(self, ctx: Context, parts: Any):
        self.ctx, self.world, self.p, self.model, self.faults = ctx, ctx.world, parts, ctx.script.model, ctx.faults
        self.last_loss: Any = None
        self.awaiting = False
        self._t_last = time.perf_counter()  # when the last step ended (seconds, perf_counter)
        self._ran_step: Optional[bool] = False  # run_step called in the first step (None once checked)

    def timed_from(self, started: float) -> None:
        """The first step is timed from ``started`` (``time.perf_counter()``, seconds)."""
        self._t_last = started

    def ran_step(self) -> None:
        """``run_step`` was called (the first step's check: does this loop call it?)."""
        if self._ran_step is not None:
            self._ran_step = True

    def open(self) -> None:
        """Open the step about to run (``guard.step_begin``)."""
        p = self.p
        self.awaiting = True
        p.call("step_begin", self.ctx.in_progress())
        if p.draws.first_step_opens():  # drawn between the resume and this first step (state.fidelity)
            p.resumer.not_bitwise(self.world.step, DRAWN_AFTER_RESUME, say=p.rejoin.joining)
        if p.heartbeat is not None and p.heartbeat.current is None:
            p.heartbeat.open("step")  # the first step stays in "setup" (warm-up, compile)

    def between(self) -> None:
        """After a step of ``guard.steps()``, before the next one opens.

        Raises:
            RuntimeError: ``step_end`` was not called in the step.
        """
        if self.awaiting:
            raise RuntimeError(f"guard.step_end() was not called in step {self.world.step}")
        if self.p.draws.next_step():
            self.p.resumer.not_bitwise(self.world.step, DRAWN_BETWEEN_STEPS)

    def should_step(self, loss: Any, grad_norm: Any) -> bool:
        """The update's check (``guard.should_step``: see there); a collective."""
        p, step = self.p, self.world.step + 1
        if p.rejoin.failure is not None:  # a peer was lost in this step: it is done again
            p.recovery.refuse()
            if p.step_start is not None:
                p.step_start.refused = True
            return False
        p.call("should_step", step)  # the step boundary kept, a replacement lined up with the survivors
        if self.faults.pending:
            self.faults.at(self.world.step, "should_step")
        if grad_norm is None:  # the norm the step's clip_grad_norm_ returned (the HF Trainer's), if any
            grad_norm = p.catch.step_norm()
        if self.faults.numeric_pending:
            loss, grad_norm = self.faults.numeric(step, loss, grad_norm, self.model)
        with p.recovering.recoverable("should_step", step) as lost:
            verdict = p.recovery.observe(step, loss, grad_norm)
            if p.reruns.pending(step):  # the re-run of an unstable step
                action = p.sdc_response.rerun_verdict(loss, self.model, self.world.hosts)
                if action is not None:
                    p.sdc_flow.act(action)
                    return False  # a persistent fault, acted on
            elif p.recovery.unstable(verdict) and p.reruns.wants(step):
                # before any policy: the hardware or the data?
                p.sdc_flow.act(p.sdc_response.rerun(verdict, loss, self.model))
                return False
            decision = p.recovery.decide(verdict)
        if lost:
            p.recovery.refuse()
            if p.step_start is not None:
                p.step_start.refused = True
            return False
        if isinstance(decision, Rollback):
            p.rollbacks.roll_back(decision)
            return False
        return decision

    def close(self, loss: Any) -> None:
        """The step boundary (``guard.step_end``: see there and the module doc)."""
        p, world = self.p, self.world
        self.awaiting = False
        p.call("step_end", self.ctx.in_progress())  # (the redo's replay, the instability recovery)
        if self._ran_step is not None:  # the first step: does this loop call run_step? (said once)
            p.inprocess.say_if_outside_run_step(self._ran_step)
            self._ran_step = None
        if p.rejoin.failure is not None and not (p.step_start and p.step_start.applied):
            p.recovering.recover(redo=True)  # a peer was lost before this step's update: steps() yields it again
            p.catch.abandon_tail()  # what the loop runs after this step_end ends the abandoned attempt
            world.rolled_back = True
        if world.rolled_back:  # the step was undone: steps() yields the checkpoint's step next
            world.rolled_back = False
            if p.heartbeat is not None:
                p.heartbeat.close_and_beat(world.step)
            return
        world.step += 1
        if self.faults.sdc_pending:  # a bit flips in a parameter, after the optimizer step
            self.faults.corrupt(world.step, self.model)
        now = time.perf_counter()
        p.stop_check.step_took(now - self._t_last)
        p.straggler.record_step(now - self._t_last)
        self._t_last = now
        self.last_loss = loss
        if p.rejoin.keeping and p.rejoin.boundary.step != world.step:  # a loop without should_step
            p.inprocess.keep_boundary(world.step)
        elif p.rejoin.keeping:  # kept before the last bucket: did the loop move its own state since?
            p.inprocess.confirm_boundary(world.step)
        if p.rejoin.failure is not None:  # the update was applied before the lost peer surfaced
            p.recovering.after_update()  # (a logging all-reduce after optimizer.step()): the step is complete
            return
        if not self._snapshot():
            return
        if self.faults.pending:  # inside the step section: an injected hang is a hang mid-step
            self.faults.at(world.step, "step")
        if p.heartbeat is not None:
            p.heartbeat.close_and_beat(world.step)
        if world.ping is not None and world.ping.failed is not None:
            raise health.PeerLostError(world.ping.failed)
        self.ctx.tell_hooks("on_step_end", world.step, loss)
        if p.sdc_flow.replicas_differ():
            return  # rolled back: steps() yields the checkpoint's step next
        p.commits.saved(p.ckpt.poll())  # finalize a background save that has finished (before its known-good verdict)
        if world.rank == 0:
            p.recovery.after_step(world.step)
        flags = p.stops.check(p.sdc_flow.stop) if p.stop_check.due(world.step) else StopFlags()
        if flags is None:  # the group changed in place: its newcomers start after this boundary, so do we
            return
        if flags.reason is not None:
            p.sdc_flow.stop(flags.reason)
        if flags.save_switch:
            p.stops.save("save_switch")
            if world.rank == 0:
                p.stop.clear_save_switch()
        elif tiers := p.ckpt.due(world.step):
            p.stops.save("interval", tiers, blocking=not p.ckpt.asynchronous)
        if p.jit is not None:  # a group restart's just-in-time save (guard.jit_save): once the boundary's work is done
            p.jit.mark(world.step)

    def _snapshot(self) -> bool:
        """A sharded model's in-memory snapshot at this boundary (:meth:`InProcess.snapshot`);
        ``False``: a peer was lost in its copy and the ranks rolled back in-process (the step
        counter is the snapshot's)."""
        with self.p.recovering.recoverable("snapshot") as lost:
            self.p.inprocess.snapshot(self.world.step)
        if lost:
            self.p.recovering.after_update()
        return not lost
