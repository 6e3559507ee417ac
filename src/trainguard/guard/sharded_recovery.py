"""The Guard's in-process recovery of a sharded model (FSDP2, HSDP): its in-memory snapshots, and
its side of a meeting with a new generation (see :mod:`trainguard.rejoin.shards`).

A component of :class:`~trainguard.guard.inprocess.InProcess`, which owns the order of a recovery
(the new group, FSDP moved onto it, the events) and calls :meth:`ShardedRecovery.meet` where a DDP
model would move its state. It never touches InProcess's attributes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Optional

import torch

from .. import console
from .. import dist as tgdist
from ..events import EventLog
from ..rejoin import sharded
from ..rejoin.protocol import Generation, is_peer_failure
from ..rejoin.rank import LOCAL_PARTS, Rejoin
from ..rejoin.rollback import from_replicas, roll_back
from ..rejoin.shards import ShardSnapshots
from ..rejoin.stepstart import StepStart
from ..state.trainstate import TrainState
from .place import Place


class ShardedRecovery:
    """A sharded model's snapshots and its recovery's meeting.

    Args:
        shards: the rank's snapshots and the copies it holds.
        model, optimizer: the sharded model and its optimizer.
        train_state: the Guard's named ``Stateful`` parts.
        rejoin: this rank's recovery state (its step boundaries, for an HSDP redo).
        events: the event log.
        step_start: the optimizer/scheduler state at the step's start (``None``: inactive).

    Attributes:
        restored: the snapshot step the last meeting rolled back to (``None``: replicas instead).
        own_state_from: a replacement: where its shard and own state came from (a rollback).
    """

    def __init__(
        self,
        shards: ShardSnapshots,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        train_state: TrainState,
        rejoin: Rejoin,
        events: EventLog,
        step_start: Optional[StepStart],
    ):
        self.shards, self.model, self.optimizer, self.train_state = shards, model, optimizer, train_state
        self.rejoin, self.events, self.step_start = rejoin, events, step_start
        self.restored: Optional[int] = None
        self.own_state_from: Optional[str] = None

    # ------------------------------------------------------------------------------------------
    # snapshots

    def open(self) -> None:
        """At the start and at the end of a meeting, on every rank (a collective): the snapshot
        copies get a group of their own."""
        self.shards.regroup()

    def snapshot(self, step: int, now: bool = False, fresh: bool = False) -> None:
        """At step ``step``'s boundary (its update applied): wait for the snapshot copy in flight,
        and take a snapshot if one is due (``now``: at any step; ``fresh``: every rank rolled back
        to a checkpoint, so the snapshots and copies of the abandoned steps are dropped first).

        Raises:
            the collective's error: a peer is gone (the caller recovers).
        """
        self.shards.settle()
        if fresh:
            self.shards.forget()
        if now or self.shards.due(step):
            self.shards.take(step, self.train_state.state_dict())

    def close(self) -> None:
        """At the end of training: wait for the last snapshot's copy (its worker must not be left in
        a transfer at exit). A lost peer there is not recovered: no step follows to need it."""
        try:
            self.shards.settle()
        except Exception as e:  # the final save meets the lost peer too, and says so
            if not is_peer_failure(e):
                raise

    def say_if_outside_run_step(self, ran: bool) -> None:
        """After the first step, on rank 0, once: a loop that does not call ``guard.run_step`` runs
        FSDP's collectives where no lost peer is caught."""
        if not ran and tgdist.rank() == 0:
            console.say(
                "in-process recovery of a sharded model catches a lost peer inside guard.run_step; this loop runs "
                "its forward and backward outside it, so a rank lost there ends its peers and the group restarts "
                "from the newest checkpoint (docs/recovery.md: Sharded models)"
            )

    def holdings(self) -> dict:
        """What this rank can roll back to (:meth:`ShardSnapshots.holdings`): read before the old
        group goes, so that a copy that arrived counts."""
        return self.shards.holdings()

    # ------------------------------------------------------------------------------------------
    # the meeting

    def meet(
        self,
        gen: Generation,
        place: Place,
        holdings: Optional[dict],
        redo: bool = False,
        kept: Optional[dict] = None,
        current: Optional[dict] = None,
    ) -> Place:
        """Both sides, on the new group (``holdings``: a survivor's; ``None`` on a replacement, with
        its lost rank's step boundaries ``kept``). With HSDP, when :func:`~trainguard.rejoin.sharded.replica_plan`
        finds one: each lost shard from a surviving replica, the step redone (``redo``) or not,
        a survivor one step behind taking the completed step (``current``: its own state at the
        end of the step it abandoned), nothing trained again (:meth:`_take_replicas`). Else every
        rank rolls back to the newest common snapshot (:meth:`_roll_back`). Then the hosts from
        the lowest survivor, and the snapshot copies on a new group, starting with this step's.
        Returns the rank's place after it.

        Raises:
            RegroupError: no snapshot every rank can roll back to.
        """
        joining = holdings is None
        said = tgdist.gather_objects((None, sorted(kept or ())) if joining else (place.step, current is not None))
        plan = sharded.replica_plan(
            sharded.replica_sets(self.model),
            steps={r: s for r, (s, _) in enumerate(said) if s is not None},
            takers={r for r, (s, takes) in enumerate(said) if s is not None and takes},
            kept={r: set(k) for r, (s, k) in enumerate(said) if s is None},
        )
        if plan is not None:
            place = self._take_replicas(place, plan, redo, kept, current)
        else:
            place = self._roll_back(gen, place, holdings)
        src = min(set(range(gen.world_size)) - set(gen.replaced))
        mine = {"hosts": list(place.hosts), "next_report": place.next_report} if place.rank == src else None
        shared: dict[str, Any] = tgdist.broadcast_object(mine, src)
        place = replace(
            place, hosts=tuple(shared["hosts"]), next_check=place.step + 1, next_report=shared["next_report"]
        )
        self.open()
        self.snapshot(place.step, now=True)
        return place

    def _roll_back(self, gen: Generation, place: Place, holdings: Optional[dict]) -> Place:
        """Every rank back to the newest common snapshot (:func:`~trainguard.rejoin.rollback.roll_back`)."""
        done = roll_back(self.shards, place.rank, gen.replaced, holdings)
        self.train_state.load_state_dict(done.train_state)
        self.events.emit(
            "snapshot_restored",
            done.step,
            rank=place.rank,
            source=done.source,
            bytes=done.bytes,
            from_step=None if holdings is None else place.step,
        )
        if holdings is None:
            self.own_state_from = done.source
        self.restored = done.step
        return replace(place, step=done.step)

    def _take_replicas(
        self, place: Place, plan: sharded.ReplicaPlan, redo: bool, kept: Optional[dict], current: Optional[dict]
    ) -> Place:
        """HSDP: each replacement, and each survivor behind, takes its shard and the shared state
        from a surviving replica (:func:`~trainguard.rejoin.rollback.from_replicas`); a replacement
        its own state from its lost rank's boundary of ``plan.step``, a survivor behind from where
        it left the step (``current``; the caller keeps it as its boundary). Survivors at
        ``plan.step`` that abandoned the next step go back to its start first."""
        joining, behind, self.restored = kept is not None, place.rank in plan.behind, None
        if not joining and redo and not behind:
            self.train_state.load_state_dict(self.rejoin.boundary.restore(place.step))
            if self.step_start is not None:
                self.step_start.restore()
        parts = [n for n in self.train_state.parts if n not in LOCAL_PARTS]
        sending = place.rank in plan.sources.values()
        shared = self.train_state.state_dict(parts) if sending else {}
        t0 = time.perf_counter()
        received, moved = from_replicas(self.model, self.optimizer, place.rank, plan.sources, shared)
        if joining:
            self.train_state.load_state_dict({**received, **kept[plan.step]})
        elif behind:
            self.train_state.load_state_dict({**received, **current})
        elif sending:
            self.events.emit(
                "state_transferred",
                place.step,
                rank=place.rank,
                to_ranks=[r for r, s in plan.sources.items() if s == place.rank],
                bytes=moved,
                seconds=round(time.perf_counter() - t0, 4),
            )
        return replace(place, step=plan.step)
