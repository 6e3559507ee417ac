"""The Guard's in-process recovery (see :mod:`trainguard.rejoin`): a survivor meets the replacement
of a lost rank, the group grows back in place, a replacement joins the survivors.

A component of :class:`~trainguard.guard.Guard`. Its inputs are the parts recovery touches (the
model, the optimizer, the training state, the :class:`~trainguard.rejoin.rank.Rejoin` state) and
the Guard's callbacks for a changed group (:class:`GroupChange`: renumber its parts, the process
groups were rebuilt, the liveness ping failed); it returns where the rank stands afterwards (:class:`Place`, :class:`Met`), which the
Guard takes. It never touches the Guard's attributes. Beside it: whether it applies
(:mod:`.applies`), trainguard's DDP hook (:mod:`.ddp_hook`), the state's move to the ranks that
lack it (:mod:`.transfer`), the progress rule (:mod:`.progress`), a step done again (:mod:`.redo`).
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Optional

from .. import console, health
from .. import dist as tgdist
from ..instability.fold import LossFold
from ..rejoin import abort, regroup, sever, sharded
from ..rejoin.align import SHOULD_STEP, wait_bound
from ..rejoin.forward import RollForward
from ..rejoin.protocol import Generation, new_rank
from ..rejoin.rank import LOCAL_PARTS, Rejoin
from ..rejoin.shards import ShardSnapshots
from ..rejoin.stepstart import StepStart
from ..state import datapos
from ..state.trainstate import TrainState
from .applies import STATEFUL_LOADER
from .context import Context
from .ddp_hook import DDPCommHook
from .keeper import Keeper
from .place import Met, Place  # re-exported: Place and Met lived here
from .progress import Progress
from .redo import StepRedo
from .sharded_recovery import ShardedRecovery
from .transfer import StateTransfer


@dataclass(frozen=True)
class GroupChange:
    """What the Guard does when in-process recovery changes the group (callbacks into the Guard).

    Attributes:
        renumber: ``renumber(rank, world_size, hosts)``: the Guard gives its parts a new rank and
            world size (a shrink or a growth), before the new group forms (:class:`~.world.Renumber`).
        regrouped: called once the default process group is rebuilt (the checkpointer's groups).
        on_ping_failure: ``on_ping_failure(why)``, given to the new group's liveness ping.
        base_world_size: ``() -> int``, the world size the run started with (``world_size_changed``).
    """

    renumber: Callable[[int, int, list[str]], None]
    regrouped: Callable[[], None]
    on_ping_failure: Callable[[str], None]
    base_world_size: Callable[[], int]


class InProcess:
    """In-process recovery of one rank: catching a lost peer in the script's own collectives,
    keeping the step-boundary state, and the three ways of meeting a new generation.

    Args:
        ctx: the Guard's :class:`~.context.Context` (``[recovery] timeout``, ``[health]``,
            ``[elastic] keep``; the script's model and optimizer, moved from a survivor to a
            replacement; the event log).
        rejoin: this rank's recovery state (store, boundary, failure, generation).
        train_state: the Guard's named ``Stateful`` parts (:class:`~trainguard.state.trainstate.TrainState`).
        step_start: the optimizer/scheduler state at the step's start (``None``: inactive).
        progress: the progress rule (:class:`~.progress.Progress`): where each meeting left this rank.
        keeper: keeps this rank's own state at a step boundary.
        ddp: trainguard's DDP hook, installed by :meth:`hook_ddp`; its ``catch`` is the Guard's
            catch of the script's collectives.
        change: what the Guard does when the group changes (:class:`GroupChange`).
        shards: a sharded model's in-memory snapshots (:mod:`~trainguard.rejoin.shards`): its
            recovery goes through :class:`~.sharded_recovery.ShardedRecovery`.
    """

    def __init__(
        self,
        ctx: Context,
        rejoin: Rejoin,
        train_state: TrainState,
        step_start: Optional[StepStart],
        progress: Progress,
        keeper: Keeper,
        ddp: DDPCommHook,
        change: GroupChange,
        shards: Optional[ShardSnapshots] = None,
    ):
        model, optimizer, events = ctx.script.model, ctx.script.optimizer, ctx.events
        self.cfg, self.rejoin, self.model, self.optimizer = ctx.cfg, rejoin, model, optimizer
        self.train_state, self.events, self.step_start = train_state, events, step_start
        self._renumber, self._regrouped, self._on_ping_failure = (
            change.renumber,
            change.regrouped,
            change.on_ping_failure,
        )
        self._base_world_size, self.progress = change.base_world_size, progress
        self.keeper = keeper
        self.sharded = (
            ShardedRecovery(shards, model, optimizer, train_state, rejoin, events, step_start) if shards else None
        )
        self.backend = tgdist.backend()
        self.ddp = ddp  # trainguard's DDP communication hook
        self.catch = ddp.catch  # this Guard's catch of the script's collectives (and its alignment)
        self.redo: Optional[StepRedo] = None  # a step done again in place (DDP or a plain module)
        if rejoin.active and step_start is not None and shards is None:
            self.redo = StepRedo(model, optimizer, train_state, step_start, rejoin, events)
        gap = self.redo.gap if self.redo is not None else None
        self.transfer = StateTransfer(model, optimizer, train_state, events, self.keeper, self.ddp.layout, gap)
        self.own_state_from: Optional[str] = None  # a replacement: where the lost rank's own state came from
        # a loader that keeps its own position, not declined because the step rolls forward: a step
        # done again would need it taken back (guard.applies.declined): such a loss restarts the group
        stateful = datapos.stateful_loaders([ctx.script.sampler])
        self.redo_refused = STATEFUL_LOADER if stateful and self.rejoin.active else None

    # ------------------------------------------------------------------------------------------
    # catching and keeping

    def catch_collectives(self, step_in_progress: Callable[[], int]) -> None:
        """Catch a lost peer in the collectives the script runs itself (see
        :mod:`~trainguard.rejoin.catch`): DDP's gradient all-reduce through trainguard's
        communication hook (:meth:`hook_ddp`, called first), the script's ``torch.distributed``
        calls. A replacement catches from the moment it joined (:meth:`arm_catch`).
        ``step_in_progress()``: the number of the step being run (``guard.step + 1``)."""
        if not self.rejoin.joining:
            self.arm_catch(step_in_progress)

    def hook_ddp(
        self,
        step_in_progress: Callable[[], int],
        fold: LossFold,
        inject: Optional[Callable[[], tuple[float, float]]] = None,
    ) -> bool:
        """Give a DDP model trainguard's communication hook (:meth:`.ddp_hook.DDPCommHook.install`),
        keeping the step boundary before the last bucket and the step's buffers for a redo.
        ``False``: nothing done (not a DDP model, or one that has trainguard's hook already)."""
        return self.ddp.install(step_in_progress, fold, self.keeper.before_last_bucket, self.step_start, inject)

    def close(self) -> None:
        """Give back what this component took of the model that can be given back (DDP's buffer
        broadcast, the interception of ``register_comm_hook``; DDP keeps a communication hook for
        good: trainguard's, calling the script's if it has one)."""
        self.ddp.close()
        if self.redo is not None:
            self.redo.close()

    def begin(self, completed: int) -> None:
        """Training starts after ``completed`` steps (the Guard's component protocol): this rank's
        own state is kept as that boundary (a replacement kept it when it joined)."""
        if self.rejoin.keeping and not self.rejoin.joining:
            self.keep_boundary(completed)

    def should_step(self, step: int) -> None:
        """The update's check of step ``step`` begins (the Guard's component protocol): this rank's
        step boundary is kept before the check's collective (see :mod:`trainguard.rejoin.boundary`),
        unless DDP's backward kept it before its last bucket (:mod:`trainguard.rejoin.catch`); in
        the first step after a meeting, this rank must line up with the survivors at the check.

        Raises:
            AlignmentError: a replacement reached the check while the survivors wait elsewhere.
        """
        if self.rejoin.keeping and self.rejoin.boundary.step != step:
            self.keep_boundary(step)
        if self.catch.align.open:
            self.catch.align.at(SHOULD_STEP, alone_ok=False)

    def step_end(self, step: int) -> None:
        """``guard.step_end`` of step ``step`` begins (the Guard's component protocol;
        :meth:`.redo.StepRedo.step_ended`)."""
        if self.redo is not None:
            self.redo.step_ended()

    def arm_catch(self, step_in_progress: Callable[[], int]) -> None:
        """Catch a lost peer in the script's ``torch.distributed`` calls from now on."""
        self.catch.arm(lambda e, where: self.rejoin.caught(e, where, step_in_progress()), self.rejoin.failed)

    def keep_boundary(self, step: int) -> None:
        """Keep this rank's own state as the boundary of step ``step`` (:meth:`.keeper.Keeper.keep`)."""
        self.keeper.keep(step)

    def confirm_boundary(self, step: int) -> None:
        """At step ``step``'s end: keep its boundary again if this rank's own state moved after its
        last gradient bucket (:meth:`.keeper.Keeper.confirm`)."""
        self.keeper.confirm(step)

    def bucket_layout(self) -> Optional[list[list[int]]]:
        """DDP's current bucket layout, as trainguard's hook last saw it (``None`` without it)."""
        return self.ddp.layout()

    def open_snapshots(self) -> None:
        """At the start, on every rank (a collective): a sharded model's snapshot copies get a
        group of their own (:class:`~.sharded_recovery.ShardedRecovery`). Nothing otherwise."""
        if self.sharded is not None:
            self.sharded.open()

    def snapshot(self, step: int, now: bool = False, fresh: bool = False) -> None:
        """A sharded model's snapshot at step ``step``'s boundary, if due (``now``: at any step;
        ``fresh``: the older ones dropped first, after a rollback). Nothing otherwise.

        Raises:
            the collective's error: a peer is gone (the caller recovers).
        """
        if self.sharded is not None:
            self.sharded.snapshot(step, now, fresh)

    def say_if_outside_run_step(self, ran: bool) -> None:
        """After the first step: a sharded model's loop without ``guard.run_step`` is told so once."""
        if self.sharded is not None:
            self.sharded.say_if_outside_run_step(ran)

    def close_snapshots(self) -> None:
        """At the end of training: wait for a sharded model's last snapshot copy."""
        if self.sharded is not None:
            self.sharded.close()

    # ------------------------------------------------------------------------------------------
    # the three meetings

    def started(self, place: Place) -> None:
        """A survivor begins recovering (before the Guard stops its ping and finishes a save in
        flight): the ``recovery_started`` event.

        Raises:
            RegroupError: the model cannot be moved to a new group, or the interrupted step's update
                may have been applied by the loop itself (:meth:`.StepStart.unguarded_update`).
        """
        self._started(place)
        why = self.step_start.unguarded_update() if self.step_start is not None and not self.sharded else None
        if why is not None and not self.step_start.applied:
            console.say(f"in-process recovery does not apply to this loss: {why}; the group restarts")
            raise regroup.RegroupError(why)

    def _started(self, place: Place) -> None:
        """The ``recovery_started`` event; the model must be movable to a new group.

        Raises:
            RegroupError: it is not (:func:`~trainguard.rejoin.regroup.check_rebindable`).
        """
        failure = self.rejoin.failure
        self.events.emit(
            "recovery_started", failure.step, rank=place.rank, during=failure.during, error=str(failure.error)[:300]
        )
        regroup.check_rebindable(self.model)

    def rolls_forward_with_all(self, place: Place, passes: int) -> bool:
        """Whether every survivor of the loss stopped where this one did (the same step boundary,
        the same backward pass ``passes``), so that they can roll the step forward together
        (:meth:`roll_forward`). With three ranks or more they may not: gloo's ring can complete a
        bucket on one rank and fail it on another, and a survivor that completed the step (its
        update applied) meets the replacement at its end. Then this rank does not meet here: its
        step goes on alone, as without roll forward (its update undone at the boundary), and it
        meets the others at the step's end, where the ranks that abandoned the step take the
        completed one (:meth:`recover`): never worse than without roll forward. Each survivor
        says where it stopped in the recovery store (:meth:`~.protocol.RecoveryStore.survivor_where`);
        this waits for the others' answers, at most ``[recovery] timeout`` seconds.

        Raises:
            the collective's error: no new generation within ``[recovery] timeout``.
            RegroupError: a survivor did not say where it stopped within the timeout.
        """
        store, timeout = self.rejoin.store, self.cfg.recovery.timeout
        gen = store.wait(self.rejoin.generation + 1, timeout)  # (not taken: roll_forward or recover takes it)
        if gen is None:
            raise self.rejoin.failure.error
        if place.rank in gen.replaced or gen.left or gen.grown:
            return True  # roll_forward refuses it, saying why
        store.survivor_where(gen.number, place.rank, place.step, passes)
        others = [r for r in range(gen.world_size) if r not in gen.replaced and r != place.rank]
        where = store.survivors_where(gen.number, others, timeout) if others else {}
        if where is None:
            raise regroup.RegroupError(f"a survivor did not say where it stopped within {timeout:g} s")
        if all(w == (place.step, passes) for w in where.values()):
            return True
        console.say(
            f"rank {place.rank}: the survivors stopped at different places of step {place.step + 1} "
            f"({sorted(set(where.values()) | {(place.step, passes)})} as (boundary, backward passes)): this rank "
            "finishes the step alone and meets the replacement at its end, as without roll forward"
        )
        return False

    def roll_forward(self, place: Place, forward: RollForward, passes: int) -> Met:
        """A peer was lost in this step's gradient buckets and backward pass ``passes`` is over
        (:mod:`~trainguard.rejoin.forward`): meet its replacement in the launcher's next
        generation, send it the state of the last step boundary (this rank's model and optimizer
        have not moved since; its buffers as the step started), and all-reduce the step's passes
        again over the new group. ``passes`` = -1: lost in the buffers' broadcast before the
        step's first forward (nothing reduced yet: the state sent as it is; the caller broadcasts
        again). The loop goes on inside its step: nothing of it is rewound.
        Call with the old group's ping stopped and no save in flight (started or not: the
        ``recovery_started`` event is written here).

        Raises:
            the collective's error: no new generation within ``[recovery] timeout``.
            RegroupError: the group changes size (a shrink or a growth meets no replacement), the
                survivors stopped at different passes, this rank was fenced out, or the model
                cannot be moved (every rank raises alike; the launcher restarts the group).
        """
        self._started(place)
        gen = self.rejoin.wait_generation()
        if place.rank in gen.replaced:
            raise regroup.RegroupError(
                f"rank {place.rank} was replaced in generation {gen.number} (its node was called lost): not rejoining"
            )
        if gen.left or gen.grown:
            raise regroup.RegroupError(
                f"generation {gen.number} changes the group's size: a step rolled forward meets replacements only"
            )
        self.rejoin.store.survivors_at(gen.number, place.step)
        self.rejoin.store.survivors_step_time(gen.number, place.step_seconds)
        self._new_group(gen)
        buffers, gap = self.ddp.buffer_sync, self.redo.gap if self.redo is not None else None
        if gap is not None:  # the step in progress is the attempt whose draws a replacement may take
            gap.rolled_forward(self.rejoin.boundary.restore(place.step).get("rng") or {})
        in_backward = passes > 0  # (else before the first forward: the buffers are the step's start)
        with buffers.at_step_start() if buffers is not None and in_backward else nullcontext():
            met = self._meet(gen, place, passes=passes, progress=forward.progress if in_backward else None)
        if gap is not None:
            gap.forget()
        step = place.step + 1
        if in_backward:
            forward.reduce_again()
            where = f"at the end of its backward pass{f' {passes}' if passes > 1 else ''}, where the gradients were "
            where += "all-reduced again"
        else:
            where = "in its first forward's broadcast of the buffers"
        said = f"nothing done again: the replacement ran step {step} from the boundary and met the survivors {where}"
        self.progress.settle(gen, met, steps_lost=0, redo_step=None, said=said, align=False)
        return met

    def resume_hook(self, progress: tuple[int, int]) -> None:
        """A replacement of survivors that rolled the step forward: its DDP hook stands where
        theirs stood as the step began, with their bucket layout (the detectors' values ride in
        the same bucket; the reducer built again at the meeting takes the same layout)."""
        self.ddp.resume(progress, self.transfer.survivors_layout)

    def met_pass(self, last: bool, step_in_progress: Callable[[], int], at_forward: bool = False) -> None:
        """A replacement all-reduced a backward pass of its first step (``step_in_progress()``)
        again with survivors that rolled it forward; ``last``: it has met them (``at_forward``: in
        the first forward's broadcast of the buffers, before any pass).

        Its DDP reducer is built afresh after each such pass, as the survivors' was at the
        meeting: a fresh reducer rebuilds its buckets (a broadcast in a forward) after its first
        backward pass, so no forward of the step rebuilds them here, and the next rebuild comes at
        the same forward on every rank; until the last, the hook keeps its progress (the
        survivors' hook did not start again between their passes). At the last, its script's
        collectives are caught from now on, and those it ran alone before (:attr:`Catch.alone`:
        the survivors had their results) make its step differ, said."""
        progress = self.ddp.progress()
        regroup.rebind_ddp(self.model, self.bucket_layout())
        if not last:
            self.ddp.resume(progress, None)
            return
        alone, step = sorted(set(self.catch.alone)), step_in_progress()
        where = (
            "in its first forward's broadcast of the buffers"
            if at_forward
            else "at the end of the step's backward pass"
        )
        self.arm_catch(step_in_progress)
        if alone:
            cause = (
                f"the replacement of rank {self.rejoin.rank} ran {', '.join(alone)} alone in step {step} before it met "
                f"the survivors {where}: "
                "the survivors had the group's result, it had its own value"
            )
            self.events.emit("resume_not_bitwise", step, rank=self.rejoin.rank, cause=cause)
            console.warn(f"a resume cannot be bitwise identical: {cause}")

    def recover(self, place: Place, redo: bool, take_completed: bool = True) -> Met:
        """A peer was lost in this step: meet its replacement in the launcher's next generation and
        send it the state; with ``redo`` restore this rank's step-boundary state so that the step
        runs again from the same batch and random numbers. Call after :meth:`started`, with the
        old group's ping stopped and no save in flight. ``take_completed``: a rank that abandoned
        the step takes it from a survivor that completed it (:meth:`_meet`; a sharded model:
        :func:`~trainguard.rejoin.sharded.replica_plan`); ``False`` (a framework's loop, which
        cannot skip the step it is in): that is refused instead (a sharded model rolls back to a
        snapshot).

        Raises:
            the collective's error: no new generation within ``[recovery] timeout`` (this rank
                exits and the launcher restarts the group).
            RegroupError: the ranks cannot be recovered in-process (same), or this rank itself was
                replaced (its node was called lost while it lived on): it must not rejoin.
        """
        if redo and self.redo_refused is not None:
            console.say(f"in-process recovery does not apply to this loss: {self.redo_refused}; the group restarts")
            raise regroup.RecoveryRefused(self.redo_refused)
        # this rank's own state now: the end of the abandoned step (a peer may have completed it)
        current = self.train_state.state_dict(LOCAL_PARTS) if redo and take_completed else None
        gen = self.rejoin.wait_generation()
        if place.rank in gen.replaced:  # its node was called lost (a partition that healed): fenced out
            raise regroup.RegroupError(
                f"rank {place.rank} was replaced in generation {gen.number} (its node was called lost): not rejoining"
            )
        if gen.replaced:  # a framework's replacement sets its loop up at this step (trainguard.hf)
            self.rejoin.store.survivor_where(gen.number, place.rank, place.step, 0)  # (rolls_forward_with_all)
            self.rejoin.store.survivors_at(gen.number, place.step)
            self.rejoin.store.survivors_step_time(gen.number, place.step_seconds)  # the launcher's bound
        if self.sharded is not None:
            return self._recover_sharded(gen, place, redo, current)
        if gen.left:
            place = self._resize(gen, place)
        self._new_group(gen)
        if redo:  # back to the step's start before any state is sent from here
            self.train_state.load_state_dict(self.rejoin.boundary.restore(place.step))
            if self.step_start is not None:
                self.step_start.restore()
            if self.redo is not None:
                self.redo.begin(place, gen)
        met = self._meet(gen, place, current=current)
        redo = redo and met.place.step == place.step  # else it took the completed step from a peer
        if not redo and self.redo is not None:  # the next step is a new one, not this one done again
            self.redo.forget()
        if gen.left:
            self.rejoin.store.joined(gen.number, met.place.rank)
        # the loop yields the step again and fetches its batch again: the same one, from its data loaders
        given = self.redo.arm() if redo and take_completed and not gen.left and self.redo is not None else 0
        redone = f"step {place.step + 1} done again" if redo else "nothing done again"
        if given:
            redone += " on the batch(es) it took from the loop's data loader"
        self.progress.settle(
            gen, met, steps_lost=0, redo_step=place.step + 1 if redo else None, said=f"no completed step lost, {redone}"
        )
        return replace(met, redo=redo)

    def grow(self, number: int, place: Place) -> Met:
        """The ranks agreed at this step boundary that the group grows back in place into
        generation ``number`` (see :mod:`~trainguard.rejoin.shrink`): take the larger world size,
        meet the newcomers in the new group and send them the state. Nothing is redone: the step is
        complete. Call with the old group's ping stopped and no save in flight.

        Raises:
            RuntimeError, torch.distributed.DistError: the new group could not be formed (this rank
                exits and the launcher restarts the group).
        """
        t0 = time.time()
        if self.sharded is not None:
            raise regroup.RegroupError("a sharded model's group does not grow back in place (its shards would move)")
        gen = self.rejoin.grown_generation(number)
        place = self._resize(gen, place)
        regroup.rebuild_default_group(gen, self.backend, self.cfg.recovery.timeout)
        regroup.rebind_ddp(self.model, self.bucket_layout())
        self._regrouped()
        met = self._meet(gen, place)
        self.progress.met(gen.number, met.place.step)
        self.catch.align.survivor(
            self.rejoin.store, gen.number, met.place.step, lowest=met.place.rank == 0, rank=met.place.rank
        )
        if met.place.rank == 0:
            self.events.emit(
                "group_grown",
                met.place.step,
                generation=gen.number,
                joined=list(gen.grown),
                world_size=met.place.world_size,
                seconds=round(time.time() - t0, 4),
            )
        return met

    def join(self, place: Place) -> Met:
        """A replacement of a lost rank starts here instead of resuming: its own state at the last
        step boundary from the lost rank's file, the model and optimizer from the survivors. A
        newcomer of a group that grows back (``gen.grown``) has no such file: it derives its own
        state from the lowest surviving rank's (see :meth:`.transfer.StateTransfer.move`). Call
        :meth:`joined` once the Guard took the returned place."""
        gen = self.rejoin.joined_generation()
        kept, self.own_state_from = ({}, None) if place.rank in gen.grown else self.rejoin.lost_boundaries(place.rank)
        if self.sharded is not None:
            met = self._on_new_group(gen, self.sharded.meet(gen, place, None, kept=kept))
            self.own_state_from = self.sharded.own_state_from or self.own_state_from
            return met
        return self._meet(gen, place, kept)

    def joined(self, met: Met, seconds: float) -> None:
        """The replacement or newcomer of :meth:`join` is in: tell the launcher, write its event;
        its collectives are compared with the survivors' until they line up (:mod:`~trainguard.rejoin.align`)."""
        self.rejoin.store.joined(met.gen.number, met.place.rank)
        self.progress.met(met.gen.number, met.place.step)
        if not met.ahead:  # rolled forward: its collectives meet the survivors' at the backward pass's end
            wait = wait_bound(self.transfer.survivors_step_seconds)
            self.catch.align.replacement(
                self.rejoin.store, met.gen.number, met.place.step, met.place.rank, wait, self._alone
            )
        said = dict(rank=met.place.rank, generation=met.gen.number, pid=os.getpid(), seconds=round(seconds, 4))
        if met.place.rank in met.gen.grown:
            self.events.emit("rank_joined", met.place.step, **said)
        else:
            self.events.emit("rank_replaced", met.place.step, own_state_from=self.own_state_from, **said)

    # ------------------------------------------------------------------------------------------
    # the parts of a meeting

    def _resize(self, gen: Generation, place: Place) -> Place:
        """The group goes on without the ranks ``gen.left`` (a shrink) or with the newcomers
        ``gen.grown`` (it grows back; see :mod:`~trainguard.rejoin.shrink`): take this rank's
        number and the world size everywhere, before the new group is created with them."""
        old, rank = place.rank, new_rank(place.rank, gen.left)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(gen.world_size))
        hosts = [h for r, h in enumerate(place.hosts) if r not in gen.left]
        hosts += list(gen.hosts) or [socket.gethostname()] * len(gen.grown)  # spares run beside us
        self._renumber(rank, gen.world_size, hosts)
        self.rejoin.renumber(rank)
        self.events.emit(
            "world_size_changed",
            place.step,
            from_world_size=place.world_size,
            to_world_size=gen.world_size,
            base_world_size=self._base_world_size(),
            keep=self.cfg.elastic.keep,
            left=list(gen.left),
            joined=list(gen.grown),
            from_rank=old,
            in_process=True,
        )
        if rank == 0:
            change = f"without rank(s) {list(gen.left)}" if gen.left else f"with rank(s) {list(gen.grown)} back"
            console.say(
                f"going on as {gen.world_size} rank(s) {change} from step {place.step}: "
                f"data position carried over, keep {self.cfg.elastic.keep.replace('_', ' ')}"
            )
        return replace(place, rank=rank, world_size=gen.world_size, hosts=tuple(hosts))

    def _meet(
        self,
        gen: Generation,
        place: Place,
        kept: Optional[dict[int, dict]] = None,
        current: Optional[dict] = None,
        passes: int = 0,
        progress: Optional[tuple[int, int]] = None,
    ) -> Met:
        """Both sides of a recovery, in the same order: agree on the survivors' step boundary (a
        replacement, with the lost rank's ``kept`` boundaries, takes the one of that step), move the
        model, optimizer and the state every rank holds alike from the lowest surviving rank to
        the replacements (none after a shrink: the survivors hold the same), start the liveness
        ping on the new group.

        The survivors may be one step apart: a collective that lost a peer can complete on some
        ranks and fail on others (gloo's ring). The ranks that abandoned the step (``current``:
        their own state at its end, :meth:`recover`) then take the completed step from the
        lowest rank that has it, as a replacement does: nothing is redone.

        ``passes``: a survivor that rolls the step forward (:meth:`roll_forward`): the backward
        passes of the step it all-reduces again (-1: it met in the first forward's broadcast of
        the buffers); 0: none (the step is done again, or complete); ``progress``: its DDP hook's progress
        as the step began (default: now). A replacement learns both (:attr:`Met.ahead`,
        :attr:`Met.hook`).

        Raises:
            RegroupError: the survivors are more than one step apart, the lost rank kept none of
                theirs, or they stopped at different passes (some roll forward, others not).
        """
        joining = kept is not None
        none = -(1 << 62)
        hook = self.ddp.progress() if progress is None else progress  # the survivors' DDP hook, for a replacement
        mine = [-1, none, none, none, -1, -1] if joining else [place.step, -place.step, passes, -passes, *hook]
        agreed = tgdist.all_reduce_max(mine)
        step, lowest = agreed[0], -agreed[1]
        if agreed[2] != -agreed[3]:
            raise regroup.RegroupError(
                f"the survivors stopped at different backward passes of the step ({-agreed[3]} to {agreed[2]} "
                "passes to all-reduce again; 0: the step is done again): one replacement cannot meet them all"
            )
        behind = not joining and place.step < step
        refused = tgdist.all_reduce_max(
            [int(joining and step not in kept and place.rank not in gen.grown), int(behind and current is None)]
        )
        if step - lowest > 1 or refused[1]:
            raise regroup.RegroupError(f"the ranks are at different step boundaries ({lowest} to {step})")
        if refused[0]:
            raise regroup.RegroupError(
                f"a replacement has no state of step {step} (its rank kept {sorted(kept or ())})"
            )
        src = None
        if step != lowest:  # the lowest rank that completed the step sends it
            src = -tgdist.all_reduce_max([-place.rank if not joining and not behind else -(1 << 62)])[0]
        if gen.replaced or src is not None:
            place = self.transfer.move(gen, place, step, kept, src, current if behind else None)
        return replace(self._on_new_group(gen, place), ahead=agreed[2], hook=(agreed[4], agreed[5]))

    def _alone(self, mine: str, theirs: str) -> None:
        """A replacement ran the collective at ``mine`` alone: the survivors wait at ``theirs``."""
        self.events.emit("collective_alone", site=mine, survivors_at=theirs)
        console.say(f"rank {self.rejoin.rank} (a replacement) ran {mine} alone: the survivors are at {theirs}")

    def _new_group(self, gen: Generation) -> None:
        """A survivor's move to ``gen``'s group: DDP lets go of the old one, its communicators are
        aborted (NCCL), the default group is created again and DDP's reducer is built on it."""
        regroup.release_ddp(self.model)
        self._abort_old(gen)
        regroup.rebuild_default_group(gen, self.backend, self.cfg.recovery.timeout, **abort.init_options(self.backend))
        regroup.rebind_ddp(self.model, self.bucket_layout())
        self._regrouped()

    def _abort_old(self, gen: Generation) -> None:
        """With the abort path on (:mod:`~trainguard.rejoin.abort`): the old world's communicators
        aborted (by the watcher already, or now) and dropped, before ``gen``'s group is created."""
        if self.rejoin.comm_abort is not None:
            self.rejoin.comm_abort.before_regroup(gen.number)

    def _on_new_group(self, gen: Generation, place: Place) -> Met:
        """The end of every meeting: note the new group's ports (cut on a lost peer), start its ping."""
        self.rejoin.group_ports = {p for ps in tgdist.gather_objects(sever.listening_ports()) for p in ps}
        device = next(self.model.parameters()).device
        ping = health.start_ping(
            self.cfg.health, list(place.hosts), self.events, device, place.world_size, self._on_ping_failure
        )
        return Met(place, ping, gen)

    def _recover_sharded(self, gen: Generation, place: Place, redo: bool, current: Optional[dict]) -> Met:
        """A survivor's recovery of a sharded model: the new group, FSDP moved onto it, the lost
        shards (and a survivor's one step behind, ``current``: its own state as it left the step)
        from replicas, or every rank rolled back to the newest common snapshot
        (:meth:`ShardedRecovery.meet`; ``steps_lost``: the completed steps trained again)."""
        if gen.left:
            raise regroup.RegroupError("a sharded model's group does not shrink in place (its shards would move)")
        holdings = self.sharded.holdings()  # before the old group goes: a copy that arrived counts
        self._abort_old(gen)
        regroup.rebuild_default_group(gen, self.backend, self.cfg.recovery.timeout, **abort.init_options(self.backend))
        sharded.rebind(self.model)
        self._regrouped()
        met = self._on_new_group(gen, self.sharded.meet(gen, place, holdings, redo=redo, current=current))
        took = self.sharded.restored is None and met.place.step > place.step  # one step behind, it took the step
        if took:
            self.keep_boundary(met.place.step)
        redo = redo and self.sharded.restored is None and not took
        if self.sharded.restored is None:
            said = "the lost shards from their replicas, no completed step lost"
        else:
            said = (
                f"every rank rolled back in memory to the snapshot of step {met.place.step} "
                f"({place.step - met.place.step} completed step(s) trained again; no file read)"
            )
        lost = max(0, place.step - met.place.step)
        self.progress.settle(gen, met, steps_lost=lost, redo_step=place.step + 1 if redo else None, said=said)
        return met
