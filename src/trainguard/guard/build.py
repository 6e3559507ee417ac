"""The order the Guard's parts are built in (:func:`build`), into a :class:`~.parts.Parts`.

Each part is built once, from its own config section, the run's :class:`~.context.Context` and the
parts it acts on, in eight steps that read top to bottom, and registered as soon as it is built
(:meth:`~.parts.Parts.add`), so a failure part-way releases exactly what was built.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import console, health
from .. import dist as tgdist
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.jit import DIRNAME, JitStore
from ..config import Config, ConfigError
from ..events import EventLog
from ..faults import FaultInjector
from ..health.straggler import StragglerDetector
from ..instability import clipfold
from ..instability.fold import LossFold
from ..instability.recovery import Recovery, Settings, Trained
from ..launch_env import LaunchEnv
from ..oom import MicroBatcher
from ..outcomes import BadInput
from ..rejoin import regroup, sharded
from ..rejoin.auth import report_forged
from ..rejoin.catch import Catch, take_handed
from ..rejoin.forward import RollForward
from ..rejoin.protocol import is_peer_failure
from ..rejoin.rank import LOCAL_PARTS, Rejoin
from ..rejoin.shards import ShardSnapshots
from ..rejoin.shrink import check_shrinkable
from ..rejoin.stepstart import StepStart
from ..rundir import prepare_run_dir
from ..sdc.crosscheck import StepInputs
from ..sdc.replicas import ReplicaCheck
from ..sdc.rerun import StepRerun
from ..state import datapos
from ..state.buckets import BucketLayout
from ..state.fidelity import DrawWatch, ResumeFidelity
from ..state.reshard import ElasticState
from ..state.trainstate import RNGState, TrainState
from ..stop.conditions import StopConditions, launch_start_time
from ..stop.memory import MemoryWatchdog
from ..stop.signals import ShutdownHandler
from ..supervisor.monitor import attempt_dir
from ..supervisor.rank import attach as attach_supervisor
from . import applies
from .boundary import Boundary
from .context import Context, Script
from .ddp_hook import DDPCommHook
from .inprocess import GroupChange, InProcess
from .jit_save import JitSave
from .keeper import Keeper
from .lifecycle import Lifecycle
from .parts import Parts
from .progress import Progress
from .recovering import Recovering
from .resume import Resume
from .rollback import Rollbacks
from .saving import Commits, StopAndSave
from .sdc_flow import SDCFlow
from .sdc_response import SDCResponse
from .stop_check import StopCheck
from .world import Renumber, World

# After a failed liveness ping, seconds the main thread gets to reach a step boundary (and raise
# PeerLostError there) before the hard deadline ends the process: it is most likely stuck in a
# collective whose peer is gone.
PING_FAILURE_GRACE = 1.0


def build(
    p: Parts,
    cfg: Config,
    world: World,
    script: Script,
    owner: Any,
    section: Callable[[str], contextlib.AbstractContextManager[None]],
) -> None:
    """Build the Guard's parts into ``p``, in order (each from its config section and the parts
    before it), registering each as it is built (:meth:`Parts.add`). ``owner``: the Guard, as the
    hooks receive it; ``section``: ``guard.section``.

    Raises:
        BadInput: an unwritable run dir or local checkpoint dir, ``checkpoint.async_save = true``
            with ``checkpoint_files``, ``[rollback] skip_batches`` without a sampler that can skip,
            a run that cannot shrink as ``[elastic]`` asks.
    """
    launch = LaunchEnv.from_environ()  # read once: the parts get what they need of it
    events = _open(p, cfg, world, script, launch)
    _services(p, cfg, world, script, launch)
    ctx = Context(cfg, world, script, events, section, owner, p.faults)
    _detectors(p, ctx)
    _state(p, ctx)
    on_ping_failure = _on_ping_failure(p, ctx)  # given to the liveness ping, of the start and of each new group
    _recovery(p, ctx, launch, on_ping_failure)
    _flows(p, ctx, on_ping_failure)
    _jit_save(p, ctx, launch)
    _install(p, ctx)
    _roll_forward(p, ctx)
    _check(p, ctx)


def _open(p: Parts, cfg: Config, world: World, s: Script, launch: LaunchEnv) -> EventLog:
    """The run directory, the event log, in-process recovery's state (and whether it applies)."""
    run_dir = Path(cfg.run.dir)
    try:
        prepare_run_dir(run_dir)
    except ConfigError as e:
        raise BadInput(str(e)) from None
    if s.checkpoint_files is not None and cfg.checkpoint.async_save is True:
        raise BadInput(
            "checkpoint.async_save = true cannot write this framework's own checkpoint files (they are "
            'written from the live state during the save); set checkpoint.async_save = false or "auto"'
        )
    p.events = events = p.add(EventLog(run_dir, world.rank, attempt=launch.restart_count))

    def peer_lost(error: str, text: str) -> None:  # told by sys.excepthook, which outlives a released log
        if p.jit is not None:  # the group restarts: this rank's part of the last completed step first
            p.jit.save("this rank lost a peer")
        if not events.closed:
            events.emit("peer_lost", error=error, traceback=text)

    def lost_or_not_recovered(exc: BaseException) -> bool:  # a refused recovery (its state untouched) too
        return is_peer_failure(exc) or isinstance(exc, regroup.RecoveryRefused)

    console.quiet_peer_loss(lost_or_not_recovered, peer_lost)
    policy = applies.recovery_policy(cfg.recovery.in_process)  # by the default group's backend (NCCL: restart)
    rolls = applies.rolls_forward(cfg.recovery.roll_forward, s.framework, s.model)
    declined = applies.declined(s.framework, s.model, policy, s.sampler, rolls) if cfg.recovery.in_process else None
    rerun = cfg.sdc.on_instability == "rerun"
    p.rejoin = p.add(
        Rejoin(
            cfg.recovery,
            launch,
            world.rank,
            keep_in_memory=rerun,
            declined=declined,
            on_forged=lambda key: report_forged(events, key),
            abort_comms=policy.abort,
        ),
        close=p.release_rejoin,
    )
    if world.rank == 0:
        applies.say_where_it_applies(
            p.rejoin, cfg.recovery.in_process, launch.recovery_store, world.world_size, s.optimizer is not None
        )
    return events


def _services(p: Parts, cfg: Config, world: World, s: Script, launch: LaunchEnv) -> None:
    """What the parts share besides the log: a step done again, the checkpointer, the signal
    handlers, the stop conditions, the hang supervisor's record, injected faults."""
    rerun = cfg.sdc.on_instability == "rerun"
    p.reruns = StepRerun(rerun, world)
    if rerun and world.world_size > 1:
        p.step_inputs = p.add(StepInputs(s.model))
    background = cfg.checkpoint.async_save is True or (
        cfg.checkpoint.async_save == "auto" and s.checkpoint_files is None
    )
    ckpt = Checkpointer(
        cfg.checkpoint,
        Path(cfg.run.dir),
        p.events,
        s.model,
        s.optimizer,
        world,
        launch.group_rank,
        launch.local_world_size,
        background=background,
        write_files=s.checkpoint_files,
    )
    p.ckpt = p.add(ckpt, close=lambda: ckpt.close(wait=p.collective))
    p.store = ckpt.store

    def on_deadline() -> None:  # the save deadline after a stop signal passed: the process ends
        p.events.emit("deadline_exit", world.step, deadline=cfg.preemption.save_deadline, signal=p.shutdown.received)

    p.shutdown = p.add(ShutdownHandler(cfg.preemption.signals, cfg.preemption.save_deadline, on_deadline).install())
    memory = MemoryWatchdog(cfg.memory, p.events)
    p.stop = StopConditions(cfg.stop, Path(cfg.run.dir), p.shutdown, memory, start_time=launch_start_time(launch))
    p.heartbeat = attach_supervisor(launch)  # under trainguard run: heartbeat + stack dumps
    p.on_release(p.detach_heartbeat)
    # a replacement of a lost rank counts as a later attempt of it: faults of the first attempt do not fire again
    attempt = max(p.events.attempt, int(p.rejoin.joining))
    p.faults = p.add(FaultInjector(cfg.faults.inject, world.rank, world.world_size, attempt, p.events))


def _on_ping_failure(p: Parts, ctx: Context) -> Callable[[str], None]:
    """What a failed liveness ping does: the hard deadline, after a grace for the main thread to
    reach a step boundary (with in-process recovery, also to wait for the replacement)."""

    def on_ping_failure(why: str) -> None:
        grace = PING_FAILURE_GRACE + (ctx.cfg.recovery.timeout if p.rejoin.active else 0.0)
        p.shutdown.deadline_timer.arm(grace, health.PING_FAILED_EXIT)

    return on_ping_failure


def _detectors(p: Parts, ctx: Context) -> None:
    """The values that ride in the step's collective and the detectors that read them: the
    instability recovery, the replica check and its response, the straggler detector, the stop check."""
    cfg, world, s = ctx.cfg, ctx.world, ctx.script
    p.fold = fold = p.add(LossFold(world))  # wired to trainguard's DDP hook or FSDP2's norm (_install)
    scaler = any(isinstance(v, torch.amp.GradScaler) and v.is_enabled() for v in s.extra_state.values())
    settings = Settings(cfg.instability, cfg.rollback, Path(cfg.run.dir), cfg.checkpoint.verify, scaler)

    def ask_hooks(event: dict) -> list[Optional[str]]:  # the hooks' say on an instability
        return ctx.tell_hooks("on_instability", dict(event))

    trained = Trained(s.model, s.optimizer, s.sampler)
    p.recovery = p.add(Recovery(settings, trained, p.store, ctx.events, world, ctx.in_progress, ask_hooks, fold))
    p.sdc = p.add(ReplicaCheck(cfg.sdc, s.model, world, ctx.events))
    p.sdc_response = SDCResponse(cfg.sdc, p.sdc, p.reruns, p.step_inputs, ctx.events, p.rejoin.active, world)
    p.straggler = StragglerDetector(cfg.straggler, world, ctx.events, Path(cfg.run.dir))
    growth = p.rejoin.growth_pending if cfg.elastic.min_ranks else None
    p.stop_check = StopCheck(p.stop, p.ckpt, p.straggler, fold, p.faults, growth, world)


def _state(p: Parts, ctx: Context) -> None:
    """What a checkpoint and a replacement take: this rank's own state and its keeper, the
    collectives' catch, micro-batches, what a bitwise resume needs, the resume, the step's start."""
    s, world = ctx.script, ctx.world
    # what a checkpoint holds per rank besides the tensors (the order is the load order: RNG last)
    own = {"sampler": datapos.position_of(s.sampler), "extra": TrainState(s.extra_state), "rng": RNGState()}
    p.keeper = Keeper(p.rejoin, TrainState({n: own[n] for n in LOCAL_PARTS}))
    # this Guard's catch of the script's collectives: a replacement's runner hands over its own
    p.catch = p.add(take_handed() or Catch())
    p.micro = p.add(
        MicroBatcher(
            ctx.cfg.oom,
            s.model,
            ctx.events,
            ctx.faults,
            p.straggler,
            world,
            p.fold,
            p.keeper.before_last_bucket,
            p.catch.align,
        )
    )
    p.fidelity, p.draws, p.elastic = ResumeFidelity(world), DrawWatch(), ElasticState(world.world_size)
    # trainguard's DDP hook, once InProcess.hook_ddp installs it: its layout is saved
    p.ddp = DDPCommHook(s.model, p.rejoin, p.catch)
    own_state = {"sampler": own["sampler"], "extra": own["extra"], "shared": TrainState(s.shared_state)}
    detectors = {"instability": p.recovery, "oom": p.micro, "fidelity": p.fidelity}
    layout = {"buckets": BucketLayout(s.model, p.ddp.layout, world), "elastic": p.elastic}
    p.train_state = TrainState({"scheduler": s.scheduler, **own_state, **detectors, **layout, "rng": own["rng"]})
    keep = ctx.cfg.elastic.keep
    p.resumer = Resume(p.ckpt, p.train_state, s.sampler, ctx.events, p.fidelity, p.draws, p.elastic, keep, world)
    if p.rejoin.active:
        p.step_start = p.add(StepStart(s.optimizer, s.scheduler, p.rejoin.failed))
    p.progress = Progress(p.rejoin, s.optimizer, p.step_start, ctx.events, s.model, p.catch.align)


def _recovery(p: Parts, ctx: Context, launch: LaunchEnv, on_ping_failure: Callable[[str], None]) -> None:
    """In-process recovery (:class:`~.inprocess.InProcess`), what follows a save, and the Guard's
    side of a recovery (:class:`~.recovering.Recovering`)."""
    world, s, elastic = ctx.world, ctx.script, p.elastic
    resized = (p.fold, p.sdc, p.straggler, p.micro)  # what holds something sized for the group
    change = GroupChange(
        Renumber(world, ctx.events, resized, s.sampler),
        p.ckpt.regroup,
        on_ping_failure,
        lambda: elastic.base_world_size,
    )
    catching = p.rejoin.active and world.world_size > 1
    shards = _shard_snapshots(ctx, launch.local_world_size) if catching else None
    p.inprocess = p.add(
        InProcess(ctx, p.rejoin, p.train_state, p.step_start, p.progress, p.keeper, p.ddp, change, shards)
    )
    p.commits = Commits(ctx, p.ckpt, p.recovery)
    p.recovering = p.add(
        Recovering(ctx, p.inprocess, p.stop_check, p.straggler, p.commits, p.recovery, p.sdc_response, p.shutdown)
    )


def _flows(p: Parts, ctx: Context, on_ping_failure: Callable[[str], None]) -> None:
    """What the step's points carry out: stop and save, rollbacks, the replica check's flow, the
    start and end of training, the step's points themselves."""
    p.stops = StopAndSave(
        ctx, p.commits, p.stop_check, p.stop, p.shutdown, p.straggler, p.recovering, p.train_state, p.catch.align
    )
    p.rollbacks = Rollbacks(ctx, p.resumer, p.commits, p.recovery, p.sdc_response, p.inprocess, p.store, p.heartbeat)
    p.sdc_flow = SDCFlow(ctx, p.sdc_response, p.fold, p.rollbacks, p.stops, p.recovering, p.straggler)
    p.lifecycle = Lifecycle(ctx, p, on_ping_failure)
    p.boundary = Boundary(ctx, p)


def _jit_save(p: Parts, ctx: Context, launch: LaunchEnv) -> None:
    """This rank's just-in-time save (``[checkpoint.jit]``), where it applies: under ``trainguard
    run`` with the hang supervisor (the launcher's request goes through its node-local directory),
    more than one rank, a replicated model, no framework's own checkpoint files. Rank 0 says once
    why not, where it was asked for and cannot apply."""
    cfg, s, world = ctx.cfg, ctx.script, ctx.world
    if not cfg.checkpoint.jit.enabled or launch.heartbeat_dir is None or world.world_size < 2:
        return
    why = None
    if sharded.is_sharded(s.model):
        why = (
            "the model is sharded (a lost rank's shard is on no survivor); a restart resumes from the newest checkpoint"
        )
    elif s.checkpoint_files is not None:
        why = "the framework writes checkpoint files of its own, which a just-in-time copy would lack"
    elif s.optimizer is None:  # an update by hand through .data moves no version counter: a torn state would pass
        why = (
            "no torch optimizer was given to the Guard (a hand-written update cannot be told apart from the "
            "step boundary's state); pass optimizer= to have the last completed step saved at a group restart"
        )
    if why is not None:
        if world.rank == 0:
            console.say(f"just-in-time save off: {why}")
        return
    timeout, ckpt = cfg.checkpoint.jit.timeout, p.ckpt

    def bound() -> float:  # 2 s + 3 x the measured write time of this run's checkpoints, at most the timeout
        return min(timeout, 2.0 + 3.0 * ckpt.estimated_save_seconds())

    directory = attempt_dir(launch.heartbeat_dir, launch.restart_count) / "jit"
    jit = JitSave(
        directory,
        JitStore(p.store.root / DIRNAME),
        world.rank,
        world.world_size,
        s.model,
        s.optimizer,
        p.stops.rank_state,
        lambda: p.train_state.state_dict(LOCAL_PARTS),
        ctx.in_progress,
        bound,
    )
    p.jit = p.add(jit, close=lambda: jit.close(failed=not p.collective))  # (a failed rank's files stay)


def _install(p: Parts, ctx: Context) -> None:
    """The process-wide wrappers, each only where the feature that needs it is on (docs/guard.md,
    "What the Guard installs"): ``clip_grad_norm_`` always, the collectives with in-process
    recovery on more than one rank, trainguard's DDP hook or the clip fold with more than one rank."""
    world, faults = ctx.world, p.faults
    catching = p.rejoin.active and world.world_size > 1  # where a lost peer is caught: the patches that serve it
    p.catch.install_clip()  # the norm clip_grad_norm_ returns is noted for should_step (Catch.step_norm)
    if catching:  # the collective catch serves in-process recovery only
        p.catch.install()
    if world.world_size > 1:  # the detectors' values ride in a DDP gradient bucket (instability.fold), or FSDP2's norm

        def inject() -> tuple[float, float]:  # the numeric faults due at this backward (armed by begin)
            return faults.at_backward(ctx.in_progress()) if faults.numeric_pending else (1.0, 1.0)

        # trainguard's DDP hook: where it catches a lost peer, or notes the bucket layout a bitwise
        # resume of three or more ranks needs (state.buckets)
        hooked = (catching or world.world_size > 2) and p.inprocess.hook_ddp(ctx.in_progress, p.fold, inject)
        if hooked or clipfold.install(ctx.script.model, p.catch, p.fold, ctx.in_progress, inject):
            # the stop flags ride, and the replica check and the straggler report too
            p.fold.connect(
                stop=p.stop_check.flags_to_fold, fingerprint=p.sdc.carry, straggler=p.stop_check.straggler_to_fold
            )
    if catching:
        p.inprocess.catch_collectives(ctx.in_progress)


def _roll_forward(p: Parts, ctx: Context) -> None:
    """``[recovery] roll_forward`` (:mod:`~trainguard.rejoin.forward`) where it applies: in-process
    recovery on more than one rank, trainguard's DDP hook installed and reducing the buckets itself,
    the script's own loop (not a framework's), and a torch that shows the autograd engine's final
    callbacks. Rank 0 says once why not, where it was asked for and cannot apply."""
    cfg, s, world = ctx.cfg, ctx.script, ctx.world
    if not cfg.recovery.roll_forward or not p.rejoin.active or world.world_size < 2:
        return
    why = None
    if s.framework or s.redo_in_step:
        why = f"{s.framework or 'a framework'}'s loop runs the step (its own state around the backward)"
    elif tgdist.backend() != "gloo":
        why = f"it is verified on gloo only, and the default group is {tgdist.backend()}"
    elif not RollForward.available():
        why = f"torch {torch.__version__} does not show the autograd engine's final callbacks"
    else:
        rejoin = p.rejoin

        def failed_during() -> Optional[str]:
            failure = rejoin.failure
            return failure.during if failure is not None else None

        forward = p.ddp.roll_forward(ctx.in_progress, failed_during)
        if forward is None:
            why = "the model is not a DDP model whose gradients trainguard's communication hook reduces"
        else:
            forward.on_lost = p.recovering.roll_forward
            forward.on_met = p.recovering.met_pass
            p.recovering.forward = forward
    if why is not None and world.rank == 0:
        console.say(f"[recovery] roll_forward does not apply: {why}; a lost peer's step is done again")


def _check(p: Parts, ctx: Context) -> None:
    """What the config asks that this run cannot do (checked once the parts exist)."""
    cfg, s = ctx.cfg, ctx.script
    if p.rejoin.active:
        check_shrinkable(cfg.elastic.min_ranks, ctx.world.world_size, s.sampler, p.ckpt.local is not None)
    if cfg.rollback.skip_batches and s.sampler is not None and not hasattr(s.sampler, "skip_batches"):
        raise BadInput(
            f"rollback.skip_batches={cfg.rollback.skip_batches} needs a sampler with a skip_batches(n) "
            f"method; {type(s.sampler).__name__} has none (use trainguard.ResumableSampler, or 0)"
        )


def _shard_snapshots(ctx: Context, local_world_size: int) -> Optional[ShardSnapshots]:
    """In-memory snapshots for a sharded model (FSDP2) under in-process recovery, else ``None``."""
    s, world = ctx.script, ctx.world
    if not sharded.is_sharded(s.model):
        return None
    interval = ctx.cfg.recovery.snapshot_interval
    return ShardSnapshots(s.model, s.optimizer, interval, world.rank, world.world_size, local_world_size)
