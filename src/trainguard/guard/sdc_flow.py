"""The Guard's silent-data-corruption flow at a step boundary: the replica check's verdict
(:mod:`trainguard.sdc.replicas`), judged by :class:`~.sdc_response.SDCResponse`, and its
action carried out (a step done again, a rollback to where the replicas last agreed, ranks
excluded), in that order."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..health.straggler import StragglerDetector
from ..instability.fold import LossFold
from ..outcomes import Withdraw
from .context import Context
from .recovering import Recovering
from .rollback import Rollbacks
from .saving import StopAndSave
from .sdc_response import SDCAction, SDCResponse


class SDCFlow:
    """The replica check's verdicts and actions, and a stop (which settles a pending check first).

    Args:
        ctx: the Guard's :class:`~.context.Context` (``[run] dir``, the world, the event log).
        response: the replica check (``response.check``) and its judge.
        fold: the detectors' values in a gradient bucket (fingerprints ride there with the DDP hook).
        rollbacks: a step done again, the rollback to the last agreeing checkpoint.
        stops: saves and stops.
        recovering: a lost peer in the check's collective.
        straggler: writes the exclude list.
    """

    def __init__(
        self,
        ctx: Context,
        response: SDCResponse,
        fold: LossFold,
        rollbacks: Rollbacks,
        stops: StopAndSave,
        recovering: Recovering,
        straggler: StragglerDetector,
    ):
        self.ctx, self.world, self.response, self.sdc, self.fold = ctx, ctx.world, response, response.check, fold
        self.rollbacks, self.stops, self.recovering, self.straggler = rollbacks, stops, recovering, straggler

    def replicas_differ(self) -> bool:
        """The replica check at this boundary (see :mod:`trainguard.sdc.replicas`): the verdict on
        the check stashed at the step before, whose fingerprints rode in this step's first DDP
        bucket; then, on a check step, this step's fingerprint stashed for the next step's bucket
        (with the DDP hook) or compared at once (an all-reduce). ``True`` when the rest of the step
        boundary is skipped: it rolled back (the step counter is the checkpoint's), or a peer was
        lost in it and replaced in-process."""
        step = self.world.step
        if self.sdc.pending is not None and self.settle(self.fold.fingerprints(step)):
            return True
        if not self.sdc.due(step):
            return False
        self.sdc.stash(step)
        if self.fold.carries_fingerprints:
            return False  # compared at the next step boundary, in that step's buckets
        return self.settle(None)

    def settle(self, carried: Optional[list[int]]) -> bool:
        """Judge the stashed replica check (``carried``: every rank's fingerprint from a gradient
        bucket; ``None``: an all-reduce, a collective) and act on it; ``True`` as :meth:`replicas_differ`."""
        with self.recovering.recoverable("sdc_check") as lost:
            step, m = self.sdc.settle(carried)
        if lost:
            self.recovering.after_update()  # the step is complete: the next check compares the replicas
            return True
        action = self.response.judge(step, m, self.world.hosts)
        if action is None:
            return False
        self.act(action)
        return True

    def settle_pending(self) -> None:
        """This step's replica check, if one is pending (before its state is saved, or at the end:
        no next bucket carries it)."""
        if self.sdc.pending is not None:
            self.settle(None)

    def stop(self, reason: str, **extra: Any) -> None:
        """Stop for ``reason`` (:meth:`StopAndSave.stop_now`), this step's replica check settled first.

        Raises:
            Requeue: always.
        """
        self.settle_pending()
        self.stops.stop_now(reason, **extra)

    def act(self, a: SDCAction) -> None:
        """Carry out a silent-data-corruption action (:class:`~.sdc_response.SDCAction`), in its order.

        Raises:
            Withdraw: this rank is among the excluded ranks under ``replace``.
            Requeue: ``exclude`` (after the stop's checkpoint).
        """
        if a.redo_step:
            self.rollbacks.redo_step()
        if a.roll_back is not None:
            self.rollbacks.to_agreement(a.roll_back)
        if not a.exclude:
            return
        ranks, hosts = list(a.exclude), list(a.hosts)
        exclude = str(Path(self.ctx.cfg.run.dir) / "exclude_nodes")
        if self.world.rank == 0:
            path = self.straggler.write_exclude(ranks)
            step = self.world.step if a.step is None else a.step
            self.ctx.events.emit(
                "sdc_exclude", step, ranks=ranks, hosts=hosts, exclude_nodes=str(path), action=a.policy
            )
        if a.policy == "replace":  # the bad ranks leave; the others meet their spares at the next collective
            if self.world.rank in a.exclude:
                raise Withdraw("sdc", a.message)
            return
        self.stop("sdc", ranks=ranks, hosts=hosts, exclude_nodes=exclude)
