"""The Guard's in-process recovery (see :mod:`trainguard.rejoin`): a survivor meets the replacement
of a lost rank, the group grows back in place, a replacement joins the survivors.

A component of :class:`~trainguard.guard.Guard`. Its inputs are the parts recovery touches (the
model, the optimizer, the training state, the :class:`~trainguard.rejoin.rank.Rejoin` state) and
three callbacks into the Guard (renumber its parts, the process groups were rebuilt, the liveness
ping failed); it returns where the rank stands afterwards (:class:`Place`, :class:`Met`), which the
Guard takes. It never touches the Guard's attributes.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat, console, health
from .. import dist as tgdist
from ..config import Config
from ..events import EventLog
from ..instability.fold import LossFold
from ..rejoin import abort, backend_policy, regroup, sever, sharded
from ..rejoin.align import ALIGN, wait_bound
from ..rejoin.buffers import BufferSync, has_buffers
from ..rejoin.catch import CATCH, DDPHook, is_own_hook
from ..rejoin.loop_check import LoopCheck
from ..rejoin.protocol import Generation, new_rank
from ..rejoin.rank import LOCAL_PARTS, Rejoin
from ..rejoin.redo_check import RedoCheck
from ..rejoin.shards import ShardSnapshots
from ..rejoin.stepstart import StepStart, schedulers_not_kept
from ..state.reshard import resharded_rank_state
from ..state.trainstate import TrainState
from .keeper import CONFIRMED, Keeper
from .place import Met, Place  # re-exported: Place and Met lived here
from .sharded_recovery import ShardedRecovery


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


def recovery_policy(in_process: backend_policy.InProcessValue) -> backend_policy.BackendPolicy:
    """The recovery for this job's default group under ``[recovery] in_process``
    (:func:`~trainguard.rejoin.backend_policy.decide`); the abort path declined where the
    installed torch lacks a member it uses (:func:`~trainguard.rejoin.abort.why_unsupported`)."""
    policy = backend_policy.decide(tgdist.backend(), in_process)
    why = abort.why_unsupported(tgdist.backend()) if policy.abort else None
    return replace(policy, in_process=False, abort=False, declined=why) if why else policy


def declined(
    framework: Optional[str], model: torch.nn.Module, policy: Optional[backend_policy.BackendPolicy] = None
) -> Optional[str]:
    """Why in-process recovery does not apply to this loop, ``None`` if it does: a framework
    drives it, the backend's ``policy`` declines it (:func:`recovery_policy`: NCCL by default), or
    the model cannot be moved to a new group (:func:`~trainguard.rejoin.regroup.check_rebindable`)."""
    if framework is not None:
        return f"{framework} owns the process group and the training loop"
    if policy is not None and policy.declined is not None:
        return policy.declined
    try:
        regroup.check_rebindable(model)
    except regroup.RegroupError as e:
        return str(e)
    return None


def say_where_it_applies(rejoin: Rejoin, in_process: bool, recovery_store: Optional[str], world_size: int) -> None:
    """Rank 0, once at start: why in-process recovery (on by default) does not apply, if it does not."""
    if rejoin.declined is not None:
        console.say(
            f"in-process recovery does not apply ({rejoin.declined}): "
            "a lost rank restarts the group from the newest checkpoint"
        )
    elif in_process and not recovery_store and world_size > 1:
        console.say(
            "in-process recovery needs `trainguard run` (this run was launched otherwise): "
            "a lost rank ends the run as its launcher decides"
        )


class DDPHookSlot:
    """Where trainguard's DDP communication hook is kept (``hook``), once :meth:`InProcess.hook_ddp`
    registered it (``None`` before, or for good: not a DDP model). Made before the training state,
    whose saved bucket layout (:class:`~trainguard.state.buckets.BucketLayout`) reads :meth:`layout`."""

    def __init__(self) -> None:
        self.hook: Optional[DDPHook] = None

    def layout(self) -> Optional[list[list[int]]]:
        """DDP's current bucket layout, as trainguard's hook last saw it (``None`` without it)."""
        return self.hook.layout if self.hook is not None and self.hook.layout else None


class InProcess:
    """In-process recovery of one rank: catching a lost peer in the script's own collectives,
    keeping the step-boundary state, and the three ways of meeting a new generation.

    Args:
        cfg: the run's config (``[recovery] timeout``, ``[health]``, ``[elastic] keep``).
        rejoin: this rank's recovery state (store, boundary, failure, generation).
        model, optimizer: what is moved from a survivor to a replacement.
        train_state: the Guard's named ``Stateful`` parts (:class:`~trainguard.state.trainstate.TrainState`).
        events: the event log.
        step_start: the optimizer/scheduler state at the step's start (``None``: inactive).
        renumber: ``renumber(rank, world_size, hosts)``: the Guard gives its parts a new rank and
            world size (a shrink or a growth), before the new group forms.
        regrouped: called once the default process group is rebuilt (the checkpointer's groups).
        on_ping_failure: given to the new group's liveness ping.
        base_world_size: the world size the run started with (for ``world_size_changed``).
        shards: a sharded model's in-memory snapshots (:mod:`~trainguard.rejoin.shards`): its
            recovery goes through :class:`~.sharded_recovery.ShardedRecovery`.
        keeper: keeps this rank's own state at a step boundary (default: one over ``train_state``).
        ddp: where :meth:`hook_ddp` keeps trainguard's DDP hook (default: a slot of its own).
    """

    def __init__(
        self,
        cfg: Config,
        rejoin: Rejoin,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        train_state: TrainState,
        events: EventLog,
        step_start: Optional[StepStart],
        renumber: Callable[[int, int, list[str]], None],
        regrouped: Callable[[], None],
        on_ping_failure: Callable[[str], None],
        base_world_size: Callable[[], int],
        shards: Optional[ShardSnapshots] = None,
        keeper: Optional[Keeper] = None,
        ddp: Optional[DDPHookSlot] = None,
    ):
        self.cfg, self.rejoin, self.model, self.optimizer = cfg, rejoin, model, optimizer
        self.train_state, self.events, self.step_start = train_state, events, step_start
        self._renumber, self._regrouped, self._on_ping_failure = renumber, regrouped, on_ping_failure
        self._base_world_size = base_world_size
        self.keeper = keeper if keeper is not None else Keeper(rejoin, train_state)
        self.sharded = (
            ShardedRecovery(shards, model, optimizer, train_state, rejoin, events, step_start) if shards else None
        )
        self.backend = tgdist.backend()
        self.ddp = ddp if ddp is not None else DDPHookSlot()  # trainguard's DDP communication hook
        self.own_state_from: Optional[str] = None  # a replacement: where the lost rank's own state came from
        self.survivors_step_seconds = 0.0  # a replacement: the survivors' step time, from the transfer
        # the generation this rank met and whose first completed step it has not told the launcher of
        # (the progress rule), with the step boundary of the meeting; a survivor's finish to say then
        self._stepping: Optional[tuple[int, int]] = None
        self._unsettled: Optional[Unsettled] = None
        self.buffer_sync: Optional[BufferSync] = None  # DDP's buffer broadcast, where a lost peer is caught
        self.redo_check: Optional[RedoCheck] = None  # a step done again must see the interrupted one's batch
        if rejoin.active and step_start is not None and shards is None:
            self.redo_check = RedoCheck(model, self._redo_differs)
            step_start.also(self.redo_check)

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
        """Give a DDP model trainguard's communication hook (:class:`~trainguard.rejoin.catch.DDPHook`):
        it carries ``fold``'s values in one bucket (:mod:`~trainguard.instability.fold`;
        ``inject``: the fault injector's numeric faults at the backward), keeps the step boundary
        before the last bucket, and catches a lost peer once :meth:`arm_catch` ran.

        A hook of the script's own composes with it: one registered before the Guard is taken over
        (the reducer is built again, as :func:`~trainguard.rejoin.regroup.rebind_ddp` builds it,
        with trainguard's hook, which calls the script's); one registered after it
        (``model.register_comm_hook``, intercepted on this instance until :meth:`close`) is called
        by trainguard's from the next backward on. Either way the detectors' values no longer ride
        in the buckets (``should_step`` all-reduces them) and rank 0 says so once.

        ``False`` (nothing done): not a DDP model, torch does not list its hooks, or it has
        trainguard's hook already (an earlier Guard's on the same model: DDP takes one)."""
        params = compat.ddp_reducer_params(self.model) if isinstance(self.model, DDP) else None
        hooks = compat.ddp_comm_hooks(self.model) if params is not None else None  # compat: None where torch lacks it
        if params is None or hooks is None or any(is_own_hook(h) for h, _ in hooks) or len(hooks) > 1:
            return False
        self.ddp.hook = hooked = DDPHook(
            CATCH,
            params,
            lambda: self.keep_before_last_bucket(step_in_progress()),
            lambda buf: fold.extra(step_in_progress(), buf),
            lambda values: fold.reduced(step_in_progress(), values),
        )
        if hooks:  # the script's, registered before the Guard: trainguard's calls it
            hook, state = hooks[0]
            compat.clear_comm_hooks(self.model)
            compat.rebuild_reducer(self.model)
            self._delegate(hook, state)
        self.model.register_comm_hook(None, hooked.hook)
        self.model.register_comm_hook = self._script_hook  # an instance attribute: removed at close()
        fold.wire(inject)
        if self.rejoin.active and has_buffers(self.model):  # a redo starts from the step's buffers
            self.buffer_sync = BufferSync(self.model, CATCH)
            if self.step_start is not None:
                self.step_start.also(self.buffer_sync)
        return True

    def _script_hook(self, state: Any, hook: Callable) -> None:
        """``model.register_comm_hook(state, hook)`` called by the script after the Guard: trainguard's
        hook calls ``hook`` from the next backward on (DDP takes one hook per model)."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: the hook must be callable, got {type(hook).__name__}")
        if self.ddp.hook.delegate is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once")
        self._delegate(hook, state)

    def _delegate(self, hook: Callable, state: Any) -> None:
        self.ddp.hook.delegate = (hook, state)
        if self.rejoin.rank == 0:
            name = getattr(hook, "__qualname__", type(hook).__name__)
            console.say(
                f"the script's DDP communication hook {name} reduces the gradients, called from trainguard's "
                "(a lost peer is caught in it); the instability detectors' values no longer ride in its "
                "buckets: should_step() all-reduces them (one small all-reduce a step)"
            )

    def close(self) -> None:
        """Give back what this component took of the model that can be given back (DDP's buffer
        broadcast, the interception of ``register_comm_hook``; DDP keeps a communication hook for
        good: trainguard's, calling the script's if it has one)."""
        if self.buffer_sync is not None:
            self.buffer_sync.close()
            self.buffer_sync = None
        if self.redo_check is not None:
            self.redo_check.close()
            self.redo_check = None
        vars(self.model).pop("register_comm_hook", None)

    def arm_catch(self, step_in_progress: Callable[[], int]) -> None:
        """Catch a lost peer in the script's ``torch.distributed`` calls from now on."""
        CATCH.arm(lambda e, where: self.rejoin.caught(e, where, step_in_progress()), self.rejoin.failed)

    def keep_boundary(self, step: int) -> None:
        """Keep this rank's own state as the boundary of step ``step`` (:meth:`.keeper.Keeper.keep`)."""
        self.keeper.keep(step)

    def confirm_boundary(self, step: int) -> None:
        """At step ``step``'s end: keep its boundary again if this rank's own state moved after its
        last gradient bucket (:meth:`.keeper.Keeper.confirm`)."""
        self.keeper.confirm(step)

    def keep_before_last_bucket(self, step: int) -> None:
        """Before step ``step``'s last gradient bucket is sent (:meth:`.keeper.Keeper.before_last_bucket`)."""
        self.keeper.before_last_bucket(step)

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
            RegroupError: the model cannot be moved to a new group.
        """
        failure = self.rejoin.failure
        self.events.emit(
            "recovery_started", failure.step, rank=place.rank, during=failure.during, error=str(failure.error)[:300]
        )
        regroup.check_rebindable(self.model)

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
        # this rank's own state now: the end of the abandoned step (a peer may have completed it)
        current = self.train_state.state_dict(LOCAL_PARTS) if redo and take_completed else None
        gen = self.rejoin.wait_generation()
        if place.rank in gen.replaced:  # its node was called lost (a partition that healed): fenced out
            raise regroup.RegroupError(
                f"rank {place.rank} was replaced in generation {gen.number} (its node was called lost): not rejoining"
            )
        if gen.replaced:  # a framework's replacement sets its loop up at this step (trainguard.hf)
            self.rejoin.store.survivors_at(gen.number, place.step)
            self.rejoin.store.survivors_step_time(gen.number, place.step_seconds)  # the launcher's bound
        if self.sharded is not None:
            return self._recover_sharded(gen, place, redo, current)
        if gen.left:
            place = self._resize(gen, place)
        regroup.release_ddp(self.model)
        self._abort_old(gen)
        regroup.rebuild_default_group(gen, self.backend, self.cfg.recovery.timeout, **abort.init_options(self.backend))
        regroup.rebind_ddp(self.model, self.bucket_layout())
        self._regrouped()
        if redo:  # back to the step's start before any state is sent from here
            self.train_state.load_state_dict(self.rejoin.boundary.restore(place.step))
            if self.step_start is not None:
                self.step_start.restore()
                self._say_stray_schedulers(place, gen)
            if gen.left and self.redo_check is not None:  # fewer ranks: each takes another share of the data
                self.redo_check.forget()
        met = self._meet(gen, place, current=current)
        redo = redo and met.place.step == place.step  # else it took the completed step from a peer
        if gen.left:
            self.rejoin.store.joined(gen.number, met.place.rank)
        redone = f"step {place.step + 1} done again" if redo else "nothing done again"
        self._settle(
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
        self._stepping = (gen.number, met.place.step)
        ALIGN.survivor(self.rejoin.store, gen.number, met.place.step, lowest=met.place.rank == 0, rank=met.place.rank)
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
        state from the lowest surviving rank's (see :meth:`_transfer`). Call
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
        self._stepping = (met.gen.number, met.place.step)
        wait = wait_bound(self.survivors_step_seconds)
        ALIGN.replacement(self.rejoin.store, met.gen.number, met.place.step, met.place.rank, wait, self._alone)
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
        self, gen: Generation, place: Place, kept: Optional[dict[int, dict]] = None, current: Optional[dict] = None
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

        Raises:
            RegroupError: the survivors are more than one step apart, or the lost rank kept none of theirs.
        """
        joining = kept is not None
        agreed = tgdist.all_reduce_max([-1, -(1 << 62)] if joining else [place.step, -place.step])
        step, lowest = agreed[0], -agreed[1]
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
            place = self._transfer(gen, place, step, kept, src, current if behind else None)
        return self._on_new_group(gen, place)

    def _settle(self, gen: Generation, met: Met, steps_lost: int, redo_step: Optional[int], said: str) -> None:
        """A survivor met ``gen``: the recovery is finished once the group completes a step with it
        (:meth:`step_completed`); the lowest survivor names its first collective from now on
        (:mod:`~trainguard.rejoin.align`). ``steps_lost``: completed steps trained again;
        ``redo_step``: the step done again, ``None`` if none; ``said``: the console's words then."""
        lowest = min(set(range(met.place.world_size)) - set(gen.replaced))
        self._stepping = (gen.number, met.place.step)
        self._unsettled = Unsettled(
            gen, met.place.step, steps_lost, redo_step, self.rejoin.failure.at, said if met.place.rank == lowest else ""
        )
        if gen.replaced:
            ALIGN.survivor(
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
        if ALIGN.active:
            ALIGN.step_end(step)
        if self._stepping is None or step <= self._stepping[1]:
            return
        number, _ = self._stepping
        self._stepping = None
        if number > 0:  # after a meeting: do the ranks' loops still agree? (not at a new start)
            scheduler = self.step_start.scheduler if self.step_start is not None else None
            LoopCheck(self.rejoin.store, self.optimizer, scheduler).check(number, rank, world_size, step)
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
        )
        if u.said:
            console.say(
                f"recovered in-process: step {step} completed on the new group {seconds:.2f} s after the fault; {u.said}"
            )

    def _redo_differs(self, why: str) -> None:
        """A survivor's step done again got another batch (:class:`~trainguard.rejoin.redo_check.RedoCheck`):
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

    def _say_unconfirmed(self, rank: int, step: int) -> None:
        """A replacement took a boundary kept before the step's last gradient bucket, and the
        survivors' own state moved after that bucket (see :mod:`.keeper`): say the resume is not
        bitwise (``resume_not_bitwise``, a console line)."""
        cause = (
            f"rank {rank} was lost after step {step}'s last gradient bucket and before the step's end, where the loop "
            "moved its own state (random numbers drawn by an evaluation's DataLoader, a batch taken after the "
            "backward): its replacement starts from the state before that move"
        )
        self.events.emit("resume_not_bitwise", step, rank=rank, cause=cause)
        console.warn(f"a resume cannot be bitwise identical: {cause}")

    def _alone(self, mine: str, theirs: str) -> None:
        """A replacement ran the collective at ``mine`` alone: the survivors wait at ``theirs``."""
        self.events.emit("collective_alone", site=mine, survivors_at=theirs)
        console.say(f"rank {self.rejoin.rank} (a replacement) ran {mine} alone: the survivors are at {theirs}")

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
        self._settle(gen, met, steps_lost=lost, redo_step=place.step + 1 if redo else None, said=said)
        return met

    def _transfer(
        self,
        gen: Generation,
        place: Place,
        step: int,
        kept: Optional[dict[int, dict]],
        src: Optional[int] = None,
        current: Optional[dict[str, Any]] = None,
    ) -> Place:
        """Move the model, optimizer and shared state from rank ``src`` (default: the lowest
        surviving rank) to the replacements of ``gen`` (``kept``: a replacement's boundaries,
        ``None`` on a survivor) and to survivors one step behind (``current``: their own state at
        ``step``). A newcomer (``gen.grown``) takes that rank's own state too, with the data
        position and RNG streams derived for its rank as on a resume on another world size
        (:func:`~trainguard.state.reshard.resharded_rank_state`). Returns the place after it."""
        joining = kept is not None
        src = min(set(range(gen.world_size)) - set(gen.replaced)) if src is None else src
        t0 = time.perf_counter()
        parts = [n for n in self.train_state.parts if gen.grown or n not in LOCAL_PARTS]
        shared = {
            "layout": self.bucket_layout(),
            "step_seconds": place.step_seconds,
            "hosts": list(place.hosts),
            "next_check": step + 1,
            "next_report": place.next_report,
            "state": self.train_state.state_dict(parts) if place.rank == src else None,
            "moved_after_bucket": self.keeper.moved_after_bucket(step),
        }
        packet, moved = regroup.transfer_state(self.model, self.optimizer, src, shared)
        self.survivors_step_seconds = float(packet.get("step_seconds") or 0.0)
        if joining:
            if packet["layout"]:  # the survivors' buckets, so that the sums round as theirs do
                regroup.rebind_ddp(self.model, packet["layout"])
            if place.rank in gen.grown:
                own = resharded_rank_state({**packet["state"], "step": step}, place.rank)
            else:
                own = kept[step]
                if packet["moved_after_bucket"] and not own.get(CONFIRMED, True):
                    self._say_unconfirmed(place.rank, step)
            self.train_state.load_state_dict({**packet["state"], **own})
            place = replace(place, step=step)
        elif current is not None:
            self.train_state.load_state_dict({**packet["state"], **current})
            place = replace(place, step=step)
        if place.rank == src:
            self.events.emit(
                "state_transferred",
                place.step,
                rank=src,
                to_ranks=list(gen.replaced),
                bytes=moved,
                seconds=round(time.perf_counter() - t0, 4),
            )
        return replace(
            place, hosts=tuple(packet["hosts"]), next_check=packet["next_check"], next_report=packet["next_report"]
        )
