"""The Guard's parts (:class:`Parts`) and the order they are built in (:func:`build`).

Each part is built once, from its own config section and the parts built before it, and gets at
construction what it needs; :class:`~.guard.Guard` then calls them at the step's points. Each part
that holds something to give back (a thread, a signal handler, a wrapper, a hook, a file) is
registered on the parts' exit stack (:meth:`Parts.on_release`) as soon as it is built, and
:meth:`Parts.release` gives them back in the reverse order. The Guard holds its :class:`Parts`
before :func:`build` fills it in, so a failure part-way (bad input found after the checkpointer
and the signal handlers exist) releases exactly what was built, by the same structure.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import console, health
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.store import CheckpointStore
from ..config import Config, ConfigError
from ..events import EventLog, Hook
from ..faults import FaultInjector
from ..health.straggler import StragglerDetector
from ..instability import clipfold
from ..instability.fold import LossFold
from ..instability.recovery import Recovery
from ..launch_env import LaunchEnv
from ..oom import MicroBatcher
from ..outcomes import BadInput
from ..rejoin import sharded
from ..rejoin.auth import report_forged
from ..rejoin.catch import Catch, take_handed
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
from ..supervisor.rank import attach as attach_supervisor
from ..supervisor.rank import detach as detach_supervisor
from . import applies
from .boundary import Boundary
from .ddp_hook import DDPCommHook
from .inprocess import InProcess
from .keeper import Keeper
from .lifecycle import Lifecycle
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


@dataclass(frozen=True)
class Script:
    """What the script handed the Guard besides its config (see :class:`~.guard.Guard`'s arguments).

    Attributes:
        model, optimizer, scheduler, sampler: the training loop's objects (``None``: absent).
        extra_state, shared_state: more ``{name: stateful}`` (this rank's own; alike on every rank).
        hooks: the script's :class:`~trainguard.events.Hook` instances (the Guard's list, shared).
        checkpoint_files: ``write(directory)`` inside each persistent save, or ``None``.
        redo_in_step: a framework's loop that recovers inside the next step.
        framework: the framework that owns the loop and the process group, or ``None``.
    """

    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    scheduler: Any
    sampler: Any
    extra_state: dict[str, Any]
    shared_state: dict[str, Any]
    hooks: list[Hook]
    checkpoint_files: Optional[Callable[[Path], None]]
    redo_in_step: bool
    framework: Optional[str]


@dataclass
class Parts:
    """The Guard's components, in the order :func:`build` makes them (``None``: not built, or
    absent in this run). The Guard shows each as a read-only attribute (``guard.ckpt``, ``guard.events``).

    Attributes:
        events: the event log. rejoin: this rank's in-process recovery state.
        reruns: a step done again (``[sdc] on_instability = "rerun"``); step_inputs: its inputs' check.
        ckpt, store: the checkpointer and its store. shutdown: the signal handlers and save deadline.
        stop: the stop conditions. heartbeat: the hang supervisor's record (under ``trainguard run``).
        faults: injected faults. fold: the values that ride in the step's collective (the
        detectors', the stop check's, the replica check's, the straggler report's).
        recovery: the instability recovery.
        sdc, sdc_response: the replica check and the response to silent data corruption.
        straggler: the straggler detector. stop_check: the stop check at step boundaries.
        micro: micro-batches on out-of-memory. fidelity, draws: what a bitwise resume needs.
        elastic: the world size the run started with. train_state: what a rank saves besides tensors.
        resumer: the resume. step_start: the optimizer/scheduler at the step's start.
        progress: the progress rule (the first completed step after a meeting).
        inprocess, recovering: in-process recovery, and the Guard's side of it.
        commits, stops: what follows a save; stop and save. rollbacks, sdc_flow: rollbacks and the
        replica check's flow. lifecycle: the start and end of training. boundary: the step's points.
        catch: this Guard's catch of the script's collectives and its ``clip_grad_norm_`` wrapper.
        stack: what :meth:`release` gives back, in the reverse order of :meth:`on_release`.
        collective: how :meth:`release` was called (read by the closers registered on the stack).
    """

    events: Optional[EventLog] = None
    rejoin: Optional[Rejoin] = None
    reruns: Optional[StepRerun] = None
    step_inputs: Optional[StepInputs] = None
    ckpt: Optional[Checkpointer] = None
    store: Optional[CheckpointStore] = None
    shutdown: Optional[ShutdownHandler] = None
    stop: Optional[StopConditions] = None
    heartbeat: Any = None
    faults: Optional[FaultInjector] = None
    fold: Optional[LossFold] = None
    recovery: Optional[Recovery] = None
    sdc: Optional[ReplicaCheck] = None
    sdc_response: Optional[SDCResponse] = None
    straggler: Optional[StragglerDetector] = None
    stop_check: Optional[StopCheck] = None
    micro: Optional[MicroBatcher] = None
    fidelity: Optional[ResumeFidelity] = None
    draws: Optional[DrawWatch] = None
    elastic: Optional[ElasticState] = None
    train_state: Optional[TrainState] = None
    resumer: Optional[Resume] = None
    step_start: Optional[StepStart] = None
    progress: Optional[Progress] = None
    inprocess: Optional[InProcess] = None
    commits: Optional[Commits] = None
    recovering: Optional[Recovering] = None
    stops: Optional[StopAndSave] = None
    rollbacks: Optional[Rollbacks] = None
    sdc_flow: Optional[SDCFlow] = None
    lifecycle: Optional[Lifecycle] = None
    boundary: Optional[Boundary] = None
    catch: Optional[Catch] = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    collective: bool = True

    def on_release(self, close: Callable[[], Any]) -> None:
        """Register ``close()`` to run at :meth:`release`, before everything registered earlier."""
        self.stack.callback(close)

    def release(self, collective: bool) -> None:
        """Release what was built, without a collective, in the reverse order of building: the
        process-wide wrappers, hooks, the heartbeat record, signal handlers, the checkpointer's
        threads (``collective``: after a background save finishes; ``False``, a failure on this
        rank alone: not waiting for it, it may wait for peers), in-process recovery's state (kept
        for a replacement after a failure alone), the event log. Every closer runs even when one
        before it raised (the first error is raised at the end). Safe to call twice."""
        self.collective = collective
        self.stack.close()

    def detach_heartbeat(self) -> None:
        """Stop writing the hang supervisor's record (the step's points read :attr:`heartbeat`)."""
        detach_supervisor(self.heartbeat)
        self.heartbeat = None

    def release_rejoin(self) -> None:
        """In-process recovery's state: closed after a collective release; a rank that fails alone
        leaves it to its replacement (only its watcher stops)."""
        if self.collective:
            self.rejoin.close()
        else:
            self.rejoin.stop_watching()


_NOT_PARTS = ("stack", "collective")
NAMES = tuple(f.name for f in fields(Parts) if f.name not in _NOT_PARTS)  # the parts (guard.ckpt, ...)


def build(
    p: Parts,
    cfg: Config,
    world: World,
    script: Script,
    owner: Any,
    section: Callable[[str], contextlib.AbstractContextManager[None]],
) -> None:
    """Build the Guard's parts into ``p``, in order (each from its config section and the parts
    before it). ``owner``: the Guard, as the hooks receive it; ``section``: ``guard.section``.

    Raises:
        BadInput: an unwritable run dir or local checkpoint dir, ``checkpoint.async_save = true``
            with ``checkpoint_files``, ``[rollback] skip_batches`` without a sampler that can skip,
            a run that cannot shrink as ``[elastic]`` asks.
    """
    s, model, optimizer, run_dir = script, script.model, script.optimizer, Path(cfg.run.dir)
    rank, world_size = world.rank, world.world_size

    def in_progress() -> int:  # the number of the step being run
        return world.step + 1

    try:
        prepare_run_dir(run_dir)
    except ConfigError as e:
        raise BadInput(str(e)) from None
    if s.checkpoint_files is not None and cfg.checkpoint.async_save is True:
        raise BadInput(
            "checkpoint.async_save = true cannot write this framework's own checkpoint files (they are "
            'written from the live state during the save); set checkpoint.async_save = false or "auto"'
        )
    launch = LaunchEnv.from_environ()  # read once: the parts get what they need of it
    p.events = events = EventLog(run_dir, rank, attempt=launch.restart_count)
    p.on_release(events.close)

    def peer_lost(error: str, text: str) -> None:  # told by sys.excepthook, which outlives a released log
        if not events.closed:
            events.emit("peer_lost", error=error, traceback=text)

    console.quiet_peer_loss(is_peer_failure, peer_lost)
    policy = applies.recovery_policy(cfg.recovery.in_process)  # by the default group's backend (NCCL: restart)
    declined = applies.declined(s.framework, model, policy, s.sampler) if cfg.recovery.in_process else None
    rerun = cfg.sdc.on_instability == "rerun"
    p.rejoin = rejoin = Rejoin(
        cfg.recovery,
        launch,
        rank,
        keep_in_memory=rerun,
        declined=declined,
        on_forged=lambda key: report_forged(events, key),
        abort_comms=policy.abort,
    )
    p.on_release(p.release_rejoin)
    catching = rejoin.active and world_size > 1  # where a lost peer is caught: the patches that serve it
    if rank == 0:
        applies.say_where_it_applies(
            rejoin, cfg.recovery.in_process, launch.recovery_store, world_size, s.optimizer is not None
        )
    p.reruns = StepRerun(rerun, world)
    p.step_inputs = StepInputs(model) if rerun and world_size > 1 else None
    if p.step_inputs is not None:
        p.on_release(p.step_inputs.close)
    background = cfg.checkpoint.async_save is True or (
        cfg.checkpoint.async_save == "auto" and s.checkpoint_files is None
    )
    p.ckpt = ckpt = Checkpointer(
        cfg.checkpoint,
        run_dir,
        events,
        model,
        optimizer,
        world,
        launch.group_rank,
        launch.local_world_size,
        background=background,
        write_files=s.checkpoint_files,
    )
    p.store = ckpt.store
    p.on_release(lambda: ckpt.close(wait=p.collective))

    def on_deadline() -> None:  # the save deadline after a stop signal passed: the process ends
        events.emit("deadline_exit", world.step, deadline=cfg.preemption.save_deadline, signal=p.shutdown.received)

    p.shutdown = shutdown = ShutdownHandler(cfg.preemption.signals, cfg.preemption.save_deadline, on_deadline).install()
    p.on_release(shutdown.close)

    def on_ping_failure(why: str) -> None:
        # with in-process recovery the main thread may be waiting for the replacement: give it that long
        grace = PING_FAILURE_GRACE + (cfg.recovery.timeout if rejoin.active else 0.0)
        shutdown.deadline_timer.arm(grace, health.PING_FAILED_EXIT)

    memory = MemoryWatchdog(cfg.memory, events)
    p.stop = StopConditions(cfg.stop, run_dir, shutdown, memory, start_time=launch_start_time(launch))
    p.heartbeat = attach_supervisor(launch)  # under trainguard run: heartbeat + stack dumps
    p.on_release(p.detach_heartbeat)
    # a replacement of a lost rank counts as a later attempt of it: faults of the first attempt do not fire again
    attempt = max(events.attempt, int(rejoin.joining))
    p.faults = faults = FaultInjector(cfg.faults.inject, rank, world_size, attempt, events)
    p.on_release(faults.close)
    p.fold = fold = LossFold(world)  # wired to trainguard's DDP hook or FSDP2's norm below, where there is one
    p.on_release(fold.close)
    loss_scaler = any(isinstance(v, torch.amp.GradScaler) and v.is_enabled() for v in s.extra_state.values())
    p.recovery = recovery = Recovery(
        cfg.instability,
        cfg.rollback,
        model,
        optimizer,
        s.sampler,
        ckpt.store,
        events,
        run_dir,
        world,
        in_progress,
        lambda event: [h.on_instability(owner, dict(event)) for h in s.hooks],  # the hooks' say on an instability
        cfg.checkpoint.verify,
        loss_scaler=loss_scaler,
        fold=fold,
    )
    p.on_release(recovery.close)
    p.sdc = sdc = ReplicaCheck(cfg.sdc, model, world, events)
    p.sdc_response = SDCResponse(cfg.sdc, sdc, p.reruns, p.step_inputs, events, rejoin.active, world)
    p.straggler = straggler = StragglerDetector(cfg.straggler, world, events, run_dir)
    growth = rejoin.growth_pending if cfg.elastic.min_ranks else None
    p.stop_check = StopCheck(p.stop, ckpt, straggler, fold, faults, growth, world)
    # what a checkpoint holds per rank besides the tensors (the order is the load order: RNG last)
    own = {"sampler": datapos.position_of(s.sampler), "extra": TrainState(s.extra_state), "rng": RNGState()}
    keeper = Keeper(rejoin, TrainState({n: own[n] for n in LOCAL_PARTS}))
    # this Guard's catch of the script's collectives: a replacement's runner hands over its own
    p.catch = take_handed() or Catch()
    p.micro = MicroBatcher(
        cfg.oom, model, events, faults, straggler, world, fold, keeper.before_last_bucket, p.catch.align
    )
    p.on_release(p.micro.close)
    p.fidelity, p.draws, p.elastic = ResumeFidelity(world), DrawWatch(), ElasticState(world_size)
    ddp = DDPCommHook(
        model, rejoin, p.catch
    )  # trainguard's DDP hook, once InProcess.hook_ddp installs it: its layout is saved
    layout = BucketLayout(model, ddp.layout, world)
    p.train_state = train_state = TrainState(
        {
            "scheduler": s.scheduler,
            "sampler": own["sampler"],
            "extra": own["extra"],
            "shared": TrainState(s.shared_state),
            "instability": recovery,
            "oom": p.micro,
            "fidelity": p.fidelity,
            "buckets": layout,
            "elastic": p.elastic,
            "rng": own["rng"],
        }
    )
    p.resumer = Resume(ckpt, train_state, s.sampler, events, p.fidelity, p.draws, p.elastic, cfg.elastic.keep, world)
    if rejoin.active:
        p.step_start = StepStart(optimizer, s.scheduler, rejoin.failed)
        p.on_release(p.step_start.close)
    resized = (fold, sdc, straggler, p.micro)  # what holds something sized for the group (every part reads world)
    elastic = p.elastic
    p.progress = Progress(rejoin, optimizer, p.step_start, events, model, p.catch.align)
    p.inprocess = ip = InProcess(
        cfg,
        rejoin,
        model,
        optimizer,
        train_state,
        events,
        p.step_start,
        Renumber(world, events, resized, s.sampler),
        ckpt.regroup,
        on_ping_failure,
        lambda: elastic.base_world_size,
        p.progress,
        shards=_shard_snapshots(cfg, script, world, launch.local_world_size) if catching else None,
        keeper=keeper,
        ddp=ddp,
    )
    p.on_release(ip.close)
    p.commits = Commits(world, ckpt, recovery, s.hooks, owner)
    p.recovering = Recovering(
        world,
        rejoin,
        ip,
        p.stop_check,
        straggler,
        p.commits,
        recovery,
        sdc,
        p.reruns,
        shutdown,
        section,
        s.redo_in_step,
    )
    p.stops = StopAndSave(
        cfg,
        world,
        ckpt,
        p.commits,
        p.stop_check,
        p.stop,
        shutdown,
        faults,
        straggler,
        events,
        p.recovering,
        section,
        train_state,
        p.catch.align,
    )
    p.rollbacks = Rollbacks(
        world,
        p.resumer,
        p.commits,
        recovery,
        sdc,
        p.reruns,
        ip,
        rejoin,
        optimizer,
        s.sampler,
        s.hooks,
        owner,
        section,
    )
    p.sdc_flow = SDCFlow(
        cfg,
        world,
        sdc,
        p.sdc_response,
        fold,
        rejoin,
        train_state,
        recovery,
        ckpt.store,
        p.commits,
        p.rollbacks,
        ip,
        p.stops,
        p.recovering,
        straggler,
        events,
        p.heartbeat,
        section,
    )
    p.lifecycle = Lifecycle(cfg, world, p, model, optimizer, s.hooks, owner, on_ping_failure)
    p.boundary = Boundary(world, p, model, s.hooks, owner)
    p.on_release(p.catch.align.close)
    p.on_release(p.catch.uninstall)  # the wrappers below are taken back first
    p.catch.install_clip()  # the norm clip_grad_norm_ returns is noted for should_step (Catch.step_norm)
    if catching:  # the collective catch serves in-process recovery only
        p.catch.install()
    if world_size > 1:  # the detectors' values ride in a DDP gradient bucket (instability.fold), or FSDP2's norm

        def inject() -> tuple[float, float]:  # the numeric faults due at this backward (armed by begin)
            return faults.at_backward(in_progress()) if faults.numeric_pending else (1.0, 1.0)

        # trainguard's DDP hook: where it catches a lost peer, or notes the bucket layout a bitwise
        # resume of three or more ranks needs (state.buckets)
        hooked = (catching or world_size > 2) and ip.hook_ddp(in_progress, fold, inject)
        if hooked or clipfold.install(model, p.catch, fold, in_progress, inject):
            # the stop flags ride, and the replica check and the straggler report too
            fold.connect(
                stop=p.stop_check.flags_to_fold, fingerprint=sdc.carry, straggler=p.stop_check.straggler_to_fold
            )
    if catching:
        ip.catch_collectives(in_progress)
    if rejoin.active:
        check_shrinkable(cfg.elastic.min_ranks, world_size, s.sampler, ckpt.local is not None)
    if cfg.rollback.skip_batches and s.sampler is not None and not hasattr(s.sampler, "skip_batches"):
        raise BadInput(
            f"rollback.skip_batches={cfg.rollback.skip_batches} needs a sampler with a skip_batches(n) "
            f"method; {type(s.sampler).__name__} has none (use trainguard.ResumableSampler, or 0)"
        )


def _shard_snapshots(cfg: Config, script: Script, world: World, local_world_size: int) -> Optional[ShardSnapshots]:
    """In-memory snapshots for a sharded model (FSDP2) under in-process recovery, else ``None``."""
    if not sharded.is_sharded(script.model):
        return None
    interval = cfg.recovery.snapshot_interval
    return ShardSnapshots(script.model, script.optimizer, interval, world.rank, world.world_size, local_world_size)
