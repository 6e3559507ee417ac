"""The Guard's silent-data-corruption flow at a step boundary: the replica check's verdict
(:mod:`trainguard.sdc.replicas`), judged by :class:`~.sdc_response.SDCResponse`, and its
action carried out (a step done again, a rollback to where the replicas last agreed, ranks
excluded), in that order."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Optional

from .. import dist as tgdist
from ..checkpoint.store import CheckpointStore
from ..config import Config
from ..events import EventLog
from ..health.straggler import StragglerDetector
from ..instability.fold import LossFold
from ..instability.recovery import Recovery
from ..outcomes import GiveUp, Withdraw
from ..rejoin.rank import Rejoin
from ..sdc.replicas import Mismatch, ReplicaCheck
from ..state.trainstate import TrainState
from .inprocess import InProcess
from .recovering import Recovering
from .rollback import Rollbacks
from .saving import Commits, StopAndSave
from .sdc_response import SDCAction, SDCResponse
from .world import World


class SDCFlow:
    """The replica check's verdicts and actions, and a stop (which settles a pending check first).

    Args:
        cfg: the run's config (``[checkpoint] verify``, ``[run] dir``).
        world: the shared view.
        sdc, response: the replica check and its judge.
        fold: the detectors' values in a gradient bucket (fingerprints ride there with the DDP hook).
        rejoin: the step boundary a step done again starts from.
        train_state: loaded from that boundary.
        recovery: the instability recovery (refuses the step done again).
        store, commits, rollbacks: the rollback to the last agreeing checkpoint.
        inprocess: the step boundary kept again after it.
        stops: saves and stops.
        recovering: a lost peer in the check's collective.
        straggler: writes the exclude list.
        events: the event log.
        heartbeat: the hang supervisor's record (beaten after a rollback), or ``None``.
        section: the hang supervisor's named sections.
    """

    def __init__(
        self,
        cfg: Config,
        world: World,
        sdc: ReplicaCheck,
        response: SDCResponse,
        fold: LossFold,
        rejoin: Rejoin,
        train_state: TrainState,
        recovery: Recovery,
        store: CheckpointStore,
        commits: Commits,
        rollbacks: Rollbacks,
        inprocess: InProcess,
        stops: StopAndSave,
        recovering: Recovering,
        straggler: StragglerDetector,
        events: EventLog,
        heartbeat: Any,
        section: Callable[[str], contextlib.AbstractContextManager[None]],
    ):
        self.cfg, self.world, self.sdc, self.response, self.fold = cfg, world, sdc, response, fold
        self.rejoin, self.train_state, self.recovery, self.store = rejoin, train_state, recovery, store
        self.commits, self.rollbacks, self.inprocess, self.stops = commits, rollbacks, inprocess, stops
        self.recovering, self.straggler, self.events = recovering, straggler, events
        self.heartbeat, self.section = heartbeat, section

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
            self.recovery.refuse()
            self.train_state.load_state_dict(self.rejoin.boundary.restore(self.world.step))
            self.world.rolled_back = True  # steps() yields the step again
        if a.roll_back is not None:
            self.roll_back_to_agreement(a.roll_back)
        if not a.exclude:
            return
        ranks, hosts = list(a.exclude), list(a.hosts)
        exclude = str(Path(self.cfg.run.dir) / "exclude_nodes")
        if self.world.rank == 0:
            path = self.straggler.write_exclude(ranks)
            step = self.world.step if a.step is None else a.step
            self.events.emit("sdc_exclude", step, ranks=ranks, hosts=hosts, exclude_nodes=str(path), action=a.policy)
        if a.policy == "replace":  # the bad ranks leave; the others meet their spares at the next collective
            if self.world.rank in a.exclude:
                raise Withdraw("sdc", a.message)
            return
        self.stop("sdc", ranks=ranks, hosts=hosts, exclude_nodes=exclude)

    def roll_back_to_agreement(self, m: Mismatch) -> None:
        """Reload the newest checkpoint at or before the last agreeing replica check on every rank
        and set the newer ones aside (a save after the corruption may hold the bad replica's tensors).

        Raises:
            GiveUp: no valid checkpoint at or before that step.
        """
        w = self.world
        with self.section("rollback"):
            self.commits.wait()
            target = (
                self.store.latest_valid(self.cfg.checkpoint.verify, before=m.last_good + 1) if w.rank == 0 else None
            )
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
            self.rollbacks.reload(target, why)
            if self.rejoin.keeping:
                self.inprocess.keep_boundary(w.step)
            if w.rank == 0:
                self.events.emit(
                    "sdc_rollback", w.step, from_step=from_step, to_step=target.step, path=str(target.path)
                )
        if self.heartbeat is not None:  # the step section was closed at this boundary already
            self.heartbeat.beat(w.step)
