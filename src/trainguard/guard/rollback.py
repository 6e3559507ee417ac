"""Rolling back in this process: every rank reloads a checkpoint (an instability rollback, a
replica mismatch's), or a step is done again from this rank's step boundary; the state a
replacement of a lost rank would start from is kept again after it."""

from __future__ import annotations

from typing import Any

from .. import dist as tgdist
from ..checkpoint.store import Checkpoint, CheckpointStore
from ..instability.recovery import Recovery, Rollback
from ..outcomes import GiveUp
from ..sdc.replicas import Mismatch
from .context import Context
from .inprocess import InProcess
from .resume import Resume
from .saving import Commits
from .sdc_response import SDCResponse


class Rollbacks:
    """Reloads a checkpoint on every rank (a collective), or this rank's step boundary.

    Args:
        ctx: the Guard's :class:`~.context.Context` (the world's step becomes the checkpoint's;
            the script's optimizer and sampler are read before a rollback; its hooks hear
            ``on_rollback(owner, from_step, to_step)``).
        resumer: loads a checkpoint (or the training state) into this process.
        commits: finishes a save in flight first (it would commit a step of the abandoned trajectory).
        recovery: the instability recovery (the rollback's target and what follows it).
        response: the replica check and step re-runs (:class:`~.sdc_response.SDCResponse`), which
            start again at the checkpoint.
        inprocess: a sharded model's snapshots, the step boundary kept again.
        store: the checkpoint store (the rollback to where the replicas last agreed).
        heartbeat: the hang supervisor's record (beaten after a replica rollback), or ``None``.
    """

    def __init__(
        self,
        ctx: Context,
        resumer: Resume,
        commits: Commits,
        recovery: Recovery,
        response: SDCResponse,
        inprocess: InProcess,
        store: CheckpointStore,
        heartbeat: Any,
    ):
        self.ctx, self.world, self.resumer, self.commits, self.recovery = ctx, ctx.world, resumer, commits, recovery
        self.response, self.inprocess, self.store, self.heartbeat = response, inprocess, store, heartbeat

    def reload(self, target: Checkpoint, why: str) -> None:
        """Load ``target`` into this process (a collective): every replica holds the same state again."""
        self.world.step = self.resumer.reload(target, why)
        self.response.check.begin(self.world.step)
        self.response.check.forget()
        self.response.reruns.forget()
        self.inprocess.snapshot(self.world.step, now=True, fresh=True)  # the abandoned steps' snapshots must not serve

    def roll_back(self, rb: Rollback) -> None:
        """Carry out an instability rollback decision: reload the known-good checkpoint in this process."""
        s = self.ctx.script
        with self.ctx.section("rollback"):
            self.commits.wait()  # a save in flight would commit a step of the abandoned trajectory afterwards
            target = self.recovery.rollback_target(rb)
            lr_before = s.optimizer.param_groups[0]["lr"] if s.optimizer is not None else None
            position = s.sampler.state_dict() if s.sampler is not None else None  # after the bad step's batch
            self.reload(target, f"rolled back from step {rb.from_step} to {target.step}")
            self.recovery.rolled_back(rb, target, position, lr_before)
            self._keep_boundary()  # the state a replacement of a lost rank starts from: after the data skip
            self.world.rolled_back = True
        self.ctx.tell_hooks("on_rollback", rb.from_step, target.step)

    def redo_step(self) -> None:
        """Do the step in progress again from this rank's step boundary (a re-run for silent data
        corruption): the update is refused, the training state is the boundary's."""
        self.recovery.refuse()
        self.resumer.train_state.load_state_dict(self.inprocess.rejoin.boundary.restore(self.world.step))
        self.world.rolled_back = True  # steps() yields the step again

    def to_agreement(self, m: Mismatch) -> None:
        """Reload the newest checkpoint at or before the last agreeing replica check on every rank
        and set the newer ones aside (a save after the corruption may hold the bad replica's tensors).

        Raises:
            GiveUp: no valid checkpoint at or before that step.
        """
        w, events = self.world, self.ctx.events
        with self.ctx.section("rollback"):
            self.commits.wait()
            verify = self.ctx.cfg.checkpoint.verify
            target = self.store.latest_valid(verify, before=m.last_good + 1) if w.rank == 0 else None
            target = tgdist.broadcast_object(target)
            if target is None:
                raise GiveUp(
                    "sdc",
                    f"the replicas differ at step {w.step} and no checkpoint is at or before step {m.last_good}, "
                    "where they last agreed",
                )
            from_step, why = w.step, f"silent data corruption found at step {w.step}"
            if w.rank == 0:
                self.store.set_aside_after(target.step, why)
            self.reload(target, why)
            self._keep_boundary()
            if w.rank == 0:
                events.emit("sdc_rollback", w.step, from_step=from_step, to_step=target.step, path=str(target.path))
        if self.heartbeat is not None:  # the step section was closed at this boundary already
            self.heartbeat.beat(w.step)

    def _keep_boundary(self) -> None:
        if self.inprocess.rejoin.keeping:
            self.inprocess.keep_boundary(self.world.step)
