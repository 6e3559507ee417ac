"""The Guard: a plain PyTorch loop gains resume, scheduled and emergency saves, and clean stops.

::

    with trainguard.Guard(cfg, model=model, optimizer=opt, scheduler=sched, sampler=sampler) as guard:
        for step in guard.steps(max_steps):      # resumes from the newest valid checkpoint
            loss = train_step(batch_for(step))
            guard.step_end(loss=loss)            # saves on schedule, stops on signal/switch/time

**Step numbers.** ``guard.step`` counts completed steps. ``steps()`` yields the 0-based index of
the step about to run, which equals ``guard.step``; that step's *number* is ``guard.step + 1``
(1-based: step number N is the N-th optimizer step). Events about a step in progress (instability,
out of memory, injected faults) carry its number; a checkpoint "at step N" holds the state after N
completed steps, and resuming from it yields N next.

At each step boundary (``step_end``), on every rank, the step is counted and timed; about once a
second the stop flags of all ranks are combined in one all-reduce (:class:`~.stop_check.StopCheck`),
so all ranks decide alike at the same step; a stop saves and raises
:class:`~trainguard.outcomes.Requeue` (exit code 75); the checkpoint interval or a save switch
saves and training goes on (docs/guard.md, "The step boundary"). When ``steps()`` runs out the
Guard saves the final state and writes an ``end`` event carrying the SHA-256 of the state.

**Outcomes.** Components raise typed outcomes (:mod:`trainguard.outcomes`: ``Requeue``,
``GiveUp``, ``BadInput``, each carrying its exit code) or return decisions (a rollback);
the Guard's public methods are the edge: on an outcome they print one line, write the ``exit``
event, release what the Guard installed and let the outcome propagate, so an uncaught one ends the
script with its code. On ``Requeue`` and ``GiveUp`` (which every rank raises at the same step) the
ranks also leave together and destroy the default process group: a gloo group torn down during
interpreter exit can abort the process, which the launcher would read as a crash.

**Lifetime.** Everything the Guard installs — signal handlers, optimizer and gradient hooks, the
liveness-ping, checkpoint-writer and deleter threads, their process groups, the heartbeat record —
is released by :meth:`Guard.close` (or leaving ``with Guard(...)``); closing twice is harmless.
So is every process-wide patch it makes: ``clip_grad_norm_`` (the norm noted for ``should_step``),
``sys.excepthook`` (a lost peer told in one line), and with in-process recovery on more than one
rank ``torch.distributed``'s collectives, ``Tensor.backward`` and DDP's communication hook
(:mod:`trainguard.rejoin.catch`).

**Components.** The Guard builds its parts from their config sections and calls them at the
step's points: stop and save (:mod:`.saving`), the replica check's flow (:mod:`.sdc_flow`),
rollbacks (:mod:`.rollback`), in-process recovery (:mod:`.inprocess`, and the Guard's side of it,
:mod:`.recovering`); they share one view of where this rank stands (:class:`.world.World`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from .. import console, health
from .. import dist as tgdist
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.store import Checkpoint
from ..config import Config, ConfigError, config_from_argv, dump_config, load_config
from ..events import EventLog, Hook
from ..faults import FaultInjector
from ..health.straggler import StragglerDetector
from ..instability import clipfold
from ..instability.recovery import Recovery, Rollback
from ..launch_env import LaunchEnv
from ..oom import MicroBatcher
from ..outcomes import BadInput, Outcome, Requeue, exit_bad_input
from ..rejoin import sever, sharded
from ..rejoin.align import ALIGN, SHOULD_STEP
from ..rejoin.auth import report_forged
from ..rejoin.catch import CATCH
from ..rejoin.protocol import is_peer_failure
from ..rejoin.rank import LOCAL_PARTS, Rejoin
from ..rejoin.shards import ShardSnapshots
from ..rejoin.shrink import check_shrinkable
from ..rejoin.stepstart import StepStart
from ..rundir import prepare_run_dir
from ..sdc.crosscheck import StepInputs
from ..sdc.replicas import ReplicaCheck
from ..sdc.rerun import StepRerun
from ..state.buckets import BucketLayout
from ..state.determinism import state_hash
from ..state.fidelity import DrawWatch, ResumeFidelity
from ..state.reshard import ElasticState, rank_batch
from ..state.trainstate import RNGState, TrainState
from ..stop.conditions import StopConditions, StopFlags, launch_start_time
from ..stop.memory import MemoryWatchdog
from ..stop.signals import ShutdownHandler
from ..supervisor.rank import attach as attach_supervisor
from ..supervisor.rank import detach as detach_supervisor
from ..supervisor.rank import enter_teardown
from . import edge, inprocess
from .inprocess import InProcess
from .keeper import Keeper
from .recovering import Caught, Recovering
from .resume import DRAWN_BEFORE_LOOP, Resume
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


class Guard:
    """Fault tolerance for one training process (one rank).

    Args:
        config: validated :class:`~trainguard.config.Config` (or a subclass).
        model: the module being trained (DDP/FSDP-wrapped or plain).
        optimizer, scheduler: optional; saved and restored with the model.
        sampler: optional data position; any object with ``state_dict()``/``load_state_dict()``
            such as :class:`~trainguard.sampler.ResumableSampler`.
        extra_state: more ``{name: stateful}`` objects to save (a GradScaler, say; their state
            must load with ``weights_only=True``). In-process recovery treats them as this rank's own
            state: a replacement takes them from the lost rank's step boundary.
        shared_state: as ``extra_state``, for state every rank holds alike (a framework's loop
            counters): a replacement of a lost rank takes it from a survivor, as it is at that
            moment (:mod:`trainguard.lightning`'s loop progress).
        hooks: :class:`~trainguard.events.Hook` instances.
        checkpoint_files: ``write(directory)``, called on every rank inside each persistent save
            before the commit: the files it writes there are checksummed and committed with the
            checkpoint (a framework's own checkpoint files: :mod:`trainguard.hf`). Saves are then
            blocking (``[checkpoint] async_save = "auto"`` or ``false``; ``true`` is refused).
        redo_in_step: a framework's loop, which cannot yield a step again (:mod:`trainguard.lightning`,
            :mod:`trainguard.hf`): a peer lost in a step is recovered inside the next one, at
            :meth:`recover_in_step`, also when the step's update was applied (until then the
            collectives of its end and of the framework's work between steps, such as validation,
            complete on this rank alone: a replacement joining between steps would not run them).
        framework: a framework that drives the loop and owns the process group, and whose loop
            in-process recovery does not cover (``"the Hugging Face Trainer"``): a lost rank restarts
            the group, and rank 0 says so once at start.

    Create it after ``torch.distributed.init_process_group`` (if distributed).

    Raises:
        BadInput: an unwritable run dir or local checkpoint dir, or ``[rollback] skip_batches``
            without a sampler that can skip (the message is printed first).
    """

    def __init__(
        self,
        config: Config,
        *,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        sampler: Any = None,
        extra_state: Optional[dict[str, Any]] = None,
        shared_state: Optional[dict[str, Any]] = None,
        hooks: tuple[Hook, ...] | list[Hook] = (),
        checkpoint_files: Optional[Callable[[Path], None]] = None,
        redo_in_step: bool = False,
        framework: Optional[str] = None,
    ):
        self.cfg = config
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.extra_state, self.shared_state = dict(extra_state or {}), dict(shared_state or {})
        self.hooks: list[Hook] = list(hooks)
        self.world = World(tgdist.rank(), tgdist.world_size())
        self.run_dir = Path(config.run.dir)
        self.last_loss: Any = None
        self.resumed_from: Optional[Checkpoint] = None
        self.state_sha256: Optional[str] = None
        self.events: Optional[EventLog] = None
        self.shutdown: Optional[ShutdownHandler] = None
        self.ckpt: Optional[Checkpointer] = None
        self.heartbeat = None
        for part in ("recovery", "micro", "faults", "step_inputs", "rejoin", "step_start", "inprocess", "commits"):
            setattr(self, part, None)  # built in order below; close() releases those that were
        self._ran_step: Optional[bool] = False  # run_step called in the first step (None once checked)
        self._t_last = time.perf_counter()
        self._awaiting_step_end = False
        self._closed = False
        self._edge = edge.Edge(self._leave)  # carries out an outcome once (see "Outcomes")
        with self._edge():
            self._build(checkpoint_files, redo_in_step, framework)

    # the shared view, as the Guard's public attributes
    step = property(lambda self: self.world.step, lambda self, v: setattr(self.world, "step", v))
    rank = property(lambda self: self.world.rank, doc="This process's rank (a shrink or growth renumbers it).")
    world_size = property(lambda self: self.world.world_size, doc="The group's size now.")
    hosts = property(lambda self: self.world.hosts, doc="Every rank's host (index = rank), from the start.")
    ping = property(lambda self: self.world.ping, doc="The liveness ping of the current group, or ``None``.")

    def _build(
        self, checkpoint_files: Optional[Callable[[Path], None]], redo_in_step: bool, framework: Optional[str]
    ) -> None:
        cfg, world, model, optimizer = self.cfg, self.world, self.model, self.optimizer
        rank, world_size = world.rank, world.world_size
        try:
            prepare_run_dir(self.run_dir)
        except ConfigError as e:
            raise BadInput(str(e)) from None
        if checkpoint_files is not None and cfg.checkpoint.async_save is True:
            raise BadInput(
                "checkpoint.async_save = true cannot write this framework's own checkpoint files (they are "
                'written from the live state during the save); set checkpoint.async_save = false or "auto"'
            )
        launch = LaunchEnv.from_environ()  # read once: the components get what they need of it
        self.events = events = EventLog(self.run_dir, rank, attempt=launch.restart_count)
        console.quiet_peer_loss(
            is_peer_failure, lambda error, text: events.emit("peer_lost", error=error, traceback=text)
        )
        policy = inprocess.recovery_policy(cfg.recovery.in_process)  # by the default group's backend (NCCL: restart)
        declined = inprocess.declined(framework, model, policy) if cfg.recovery.in_process else None
        rerun = cfg.sdc.on_instability == "rerun"
        self.rejoin = rejoin = Rejoin(
            cfg.recovery,
            launch,
            rank,
            keep_in_memory=rerun,
            declined=declined,
            on_forged=lambda key: report_forged(events, key),
            abort_comms=policy.abort,
        )
        catching = rejoin.active and world_size > 1  # where a lost peer is caught: the patches that serve it
        if rank == 0:
            inprocess.say_where_it_applies(rejoin, cfg.recovery.in_process, launch.recovery_store, world_size)
        self.reruns = StepRerun(rerun, rank, world_size)
        self.step_inputs = StepInputs(model) if rerun and world_size > 1 else None
        background = cfg.checkpoint.async_save is True or (
            cfg.checkpoint.async_save == "auto" and checkpoint_files is None
        )
        self.ckpt = Checkpointer(
            cfg.checkpoint,
            self.run_dir,
            events,
            model,
            optimizer,
            rank,
            world_size,
            launch.group_rank,
            launch.local_world_size,
            background=background,
            write_files=checkpoint_files,
        )
        self.store = self.ckpt.store
        self.shutdown = ShutdownHandler(
            cfg.preemption.signals, cfg.preemption.save_deadline, self._on_deadline
        ).install()
        memory = MemoryWatchdog(cfg.memory, events)
        self.stop = StopConditions(cfg.stop, self.run_dir, self.shutdown, memory, start_time=launch_start_time(launch))
        self.heartbeat = attach_supervisor(launch)  # under trainguard run: heartbeat + stack dumps
        # a replacement of a lost rank counts as a later attempt of it: faults of the first attempt do not fire again
        attempt = max(events.attempt, int(rejoin.joining))
        self.faults = FaultInjector(cfg.faults.inject, rank, world_size, attempt, events)
        loss_scaler = any(isinstance(v, torch.amp.GradScaler) and v.is_enabled() for v in self.extra_state.values())
        self.recovery = Recovery(
            cfg.instability,
            cfg.rollback,
            model,
            optimizer,
            self.sampler,
            self.store,
            events,
            self.run_dir,
            rank,
            world_size,
            lambda: world.step + 1,
            self._ask_hooks,
            cfg.checkpoint.verify,
            loss_scaler=loss_scaler,
        )
        fold = self.recovery.fold
        self.sdc = ReplicaCheck(cfg.sdc, model, rank, world_size, events)
        self.sdc_response = SDCResponse(
            cfg.sdc, self.sdc, self.reruns, self.step_inputs, events, rejoin.active, rank, world_size
        )
        hosts = [socket.gethostname()] * world_size
        self.straggler = StragglerDetector(cfg.straggler, rank, world_size, hosts, events, self.run_dir)
        growth = rejoin.growth_pending if cfg.elastic.min_ranks else None
        self.stop_check = StopCheck(self.stop, self.ckpt, self.straggler, fold, self.faults, growth, rank)
        # what a checkpoint holds per rank besides the tensors (the order is the load order: RNG last)
        own = {"sampler": self.sampler, "extra": TrainState(self.extra_state), "rng": RNGState()}
        keeper = Keeper(rejoin, TrainState({n: own[n] for n in LOCAL_PARTS}))
        self.micro = MicroBatcher(
            cfg.oom, model, events, self.faults, self.straggler, rank, world_size, fold, keeper.before_last_bucket
        )
        self.fidelity, self.draws = ResumeFidelity(world_size), DrawWatch()
        layout = BucketLayout(model, lambda: self.inprocess.bucket_layout(), world_size)  # (InProcess: built below)
        self.elastic = ElasticState(world_size)
        self.train_state = TrainState(
            {
                "scheduler": self.scheduler,
                "sampler": own["sampler"],
                "extra": own["extra"],
                "shared": TrainState(self.shared_state),
                "instability": self.recovery,
                "oom": self.micro,
                "fidelity": self.fidelity,
                "buckets": layout,
                "elastic": self.elastic,
                "rng": own["rng"],
            }
        )
        self.resumer = Resume(
            self.ckpt,
            self.train_state,
            self.sampler,
            events,
            self.fidelity,
            self.draws,
            self.elastic,
            cfg.elastic.keep,
            rank,
            world_size,
        )
        if rejoin.active:
            self.step_start = StepStart(optimizer, self.scheduler, rejoin.failed)
        numbered = (
            self.ckpt,
            self.recovery,
            self.sdc,
            self.sdc_response,
            self.micro,
            self.reruns,
            self.resumer,
            self.stop_check,
        )
        self.inprocess = InProcess(
            cfg,
            rejoin,
            model,
            optimizer,
            self.train_state,
            events,
            self.step_start,
            Renumber(world, events, numbered, self.straggler, (self.fidelity, layout), self.sampler),
            self.ckpt.regroup,
            self._on_ping_failure,
            lambda: self.elastic.base_world_size,
            shards=self._shard_snapshots(launch.local_world_size) if catching else None,
            keeper=keeper,
        )
        self.commits = Commits(world, self.ckpt, self.recovery, self.hooks, self)
        self.recovering = Recovering(
            world,
            rejoin,
            self.inprocess,
            self.stop_check,
            self.straggler,
            self.commits,
            self.recovery,
            self.sdc,
            self.reruns,
            self.shutdown,
            self.section,
            redo_in_step,
        )
        self.stops = StopAndSave(
            cfg,
            world,
            self.ckpt,
            self.commits,
            self.stop_check,
            self.stop,
            self.shutdown,
            self.faults,
            self.straggler,
            events,
            self.recovering,
            self.section,
            self.train_state,
        )
        self.rollbacks = Rollbacks(
            world,
            self.resumer,
            self.commits,
            self.recovery,
            self.sdc,
            self.reruns,
            self.inprocess,
            rejoin,
            optimizer,
            self.sampler,
            self.hooks,
            self,
            self.section,
        )
        self.sdc_flow = SDCFlow(
            cfg,
            world,
            self.sdc,
            self.sdc_response,
            fold,
            rejoin,
            self.train_state,
            self.recovery,
            self.store,
            self.commits,
            self.rollbacks,
            self.inprocess,
            self.stops,
            self.recovering,
            self.straggler,
            events,
            self.heartbeat,
            self.section,
        )
        CATCH.install_clip()  # the norm clip_grad_norm_ returns is noted for should_step (CATCH.step_norm)
        if catching:  # the collective catch serves in-process recovery only
            CATCH.install()
        if world_size > 1:  # the detectors' values ride in a DDP gradient bucket (instability.fold), or FSDP2's norm
            in_progress, inject = (lambda: world.step + 1), self._inject_at_backward
            # trainguard's DDP hook: where it catches a lost peer, or notes the bucket layout a bitwise
            # resume of three or more ranks needs (state.buckets)
            hooked = (catching or world_size > 2) and self.inprocess.hook_ddp(in_progress, fold, inject)
            if hooked or clipfold.install(model, fold, in_progress, inject):
                fold.stop_source = self.stop_check.flags_to_fold
                fold.fingerprint_source = self.sdc.carry  # the replica check rides too
                fold.straggler_source = self.stop_check.straggler_to_fold  # and the straggler report
        if catching:
            self.inprocess.catch_collectives(lambda: world.step + 1)
        if rejoin.active:
            check_shrinkable(cfg.elastic.min_ranks, world_size, self.sampler, self.ckpt.local is not None)
        if cfg.rollback.skip_batches and self.sampler is not None and not hasattr(self.sampler, "skip_batches"):
            raise BadInput(
                f"rollback.skip_batches={cfg.rollback.skip_batches} needs a sampler with a skip_batches(n) "
                f"method; {type(self.sampler).__name__} has none (use trainguard.ResumableSampler, or 0)"
            )

    def _inject_at_backward(self) -> tuple[float, float]:
        """(loss factor, gradient factor) of the numeric faults due at this backward (see
        :meth:`~trainguard.faults.FaultInjector.at_backward`; armed by :meth:`steps`)."""
        return self.faults.at_backward(self.world.step + 1) if self.faults.numeric_pending else (1.0, 1.0)

    def section(self, name: str) -> contextlib.AbstractContextManager[None]:
        """``with guard.section("eval"): ...``: a named section the hang supervisor times (and learns)."""
        return self.heartbeat.section(name) if self.heartbeat is not None else contextlib.nullcontext()

    def recoverable(self, where: str) -> Caught:
        """``with guard.recoverable("backward") as lost: ...``: for an integration's own call into
        the step (a framework's training step): a lost peer there under in-process recovery is
        recorded at ``where`` in the step in progress and ends the block, ``lost`` then true (the
        step is done again after the recovery); any other error propagates."""
        return self.recovering.recoverable(where, self.world.step + 1)

    @property
    def in_process(self) -> bool:
        """Whether in-process recovery is on for this run (``[recovery] in_process``, under
        ``trainguard run``, not declined for this loop)."""
        return self.rejoin.active

    @property
    def joining(self) -> bool:
        """Whether this process is the replacement of a lost rank (or a newcomer) that joins the
        survivors at :meth:`begin` instead of resuming from a checkpoint."""
        return self.rejoin.joining

    def release_step(self) -> None:
        """After :meth:`should_step` returned ``False``: let ``optimizer.step()`` run in this step,
        for a framework that calls it whatever a callback decided (the Hugging Face Trainer). Set
        the gradients to ``None`` first, so that torch's optimizers leave the parameters alone."""
        self.recovery.release()

    def take_back_signals(self) -> None:
        """Install the Guard's signal handlers again over a framework's, put in place after the
        Guard (Lightning's at the start of ``fit``); :meth:`close` still restores the ones found first."""
        self.shutdown.take_back()

    def _shard_snapshots(self, local_world_size: int) -> Optional[ShardSnapshots]:
        """In-memory snapshots for a sharded model (FSDP2) under in-process recovery, else ``None``."""
        if not sharded.is_sharded(self.model):
            return None
        interval = self.cfg.recovery.snapshot_interval
        return ShardSnapshots(
            self.model, self.optimizer, interval, self.world.rank, self.world.world_size, local_world_size
        )

    @classmethod
    def from_config(
        cls,
        path: str | os.PathLike | None = None,
        *,
        overrides: Optional[list[str]] = None,
        schema: type[Config] = Config,
        **kwargs: Any,
    ) -> Guard:
        """Build a Guard from a TOML file (or, with ``path=None``, from the script's ``--config``/``--set``
        arguments and the launcher's environment).

        Raises:
            BadInput: a config error (printed first).
        """
        try:
            cfg = load_config(path, overrides, schema) if path else config_from_argv(schema)
        except ConfigError as e:
            exit_bad_input(str(e))
        return cls(cfg, **kwargs)

    def rank_batch(self, batch: int) -> int:
        """The batch this rank trains per step, given the per-rank ``batch`` the script configures
        for the world size the run started with (``[elastic] keep``, see :mod:`trainguard.state.reshard`);
        ``batch`` itself until the world size changes. Call it inside the loop.

        Raises:
            BadInput: ``keep = "global_batch"`` and the global batch does not divide by the world size.
        """
        with self._edge():
            return rank_batch(batch, self.cfg.elastic.keep, self.elastic.base_world_size, self.world_size)

    # ------------------------------------------------------------------------------------------
    # the loop

    def steps(self, max_steps: int) -> Iterator[int]:
        """Yield step indices from the resumed step up to ``max_steps - 1`` (see "Step numbers").

        Call :meth:`step_end` once per yielded step. (A framework's loop, which calls back rather
        than iterating, uses :meth:`begin`, :meth:`step_begin` and :meth:`finish` instead.)

        Raises:
            Requeue: the kill switch was set before training (exit code 75).
            BadInput: ``checkpoint.interval`` > ``max_steps`` without ``save_final``, a checkpoint
                that does not fit, a failed preflight check (exit code 2).
        """
        self.begin(max_steps)
        while self.step < max_steps:
            self.step_begin()
            yield self.step
            if self._awaiting_step_end:
                raise RuntimeError(f"guard.step_end() was not called in step {self.step}")
            if self.draws.next_step():
                self.resumer.not_bitwise(
                    self.step,
                    "random numbers were drawn between guard.step_end() and the next step (a batch fetched "
                    "after step_end?): the checkpoint's generator state does not cover them; draw them inside the step",
                )
        self.finish()

    def begin(self, max_steps: int) -> int:
        """Start training (what ``steps()`` does before its first step): resume from the newest
        valid checkpoint, start the liveness ping, write the ``start`` event. For loops driven by a
        framework's callbacks (:mod:`trainguard.lightning`, :mod:`trainguard.hf`); a collective.

        Args:
            max_steps: the step count the run trains to (fault injection and the save-interval
                check read it).
        Returns:
            The index of the first step to run (the resumed step; 0 on a fresh start).
        Raises:
            as :meth:`steps`.
        """
        with self._edge():
            c = self.cfg.checkpoint
            if not c.save_final and c.interval > max_steps:
                raise BadInput(
                    f"checkpoint.interval ({c.interval}) is larger than max_steps ({max_steps}) and "
                    "checkpoint.save_final is false: the persistent tier would never save"
                )
            joining = self.rejoin.joining
            self._begin()
            self.faults.arm(max_steps)
            self.faults.watch_activations(self.model, lambda: self.step + 1)
            # nanoGPT's prefetch: a first batch drawn before the generators were restored (state.fidelity)
            self.draws.watch_first_step(
                self.model,
                joining or self.resumed_from is not None,
                lambda cause: self.resumer.not_bitwise(self.step, cause, say=joining),
            )
        return self.step

    def step_begin(self) -> None:
        """Open the step about to run (what ``steps()`` does before each yield): the hang
        supervisor times it in the ``step`` section (the first step stays in ``setup``). Call
        :meth:`step_end` to close it."""
        self._awaiting_step_end = True
        CATCH.new_step()
        self.catch_peers()
        if self.step_start is not None:
            self.step_start.begin()
        if self.heartbeat is not None and self.heartbeat.current is None:
            self.heartbeat.open("step")  # the first step stays in "setup" (warm-up, compile)
        if self.step_inputs is not None:
            self.step_inputs.step_started()

    def finish(self) -> None:
        """End training (what ``steps()`` does after its last step): the final save (``[checkpoint]
        save_final``), the ``end`` event with the state's SHA-256 (``guard.state_sha256``), and all
        ranks leave together; a collective.

        Raises:
            GiveUp: ``[checkpoint] max_failures`` saves in a row failed.
        """
        with self._edge():
            self._finish()

    def should_step(self, loss: Any, grad_norm: Any = None) -> bool:
        """Check the step for instability after ``backward()``; apply it only if this returns ``True``::

            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if guard.should_step(loss, grad_norm):
                optimizer.step()
                scheduler.step()
            guard.step_end(loss=loss)

        Runs the ``[instability]`` detectors (non-finite loss or gradients, loss and gradient-norm
        spikes) with one all-reduce and one device→host sync, and acts on every rank alike: ``False``
        after a skip (gradients zeroed) or a rollback (state reloaded from a known-good checkpoint;
        the next yielded step is the checkpoint's). With ``[sdc] on_instability = "rerun"`` an
        unstable step is first done again: ``False``, and ``steps()`` yields the same step, whose
        batch and random numbers come back (see :mod:`trainguard.sdc.rerun`). A collective: call it
        on every rank.

        Args:
            loss: this rank's loss (0-dim tensor or float).
            grad_norm: the total gradient norm (e.g. ``clip_grad_norm_``'s return value); ``None``:
                the norm that ``torch.nn.utils.clip_grad_norm_`` returned in this step if it ran
                once (the Hugging Face Trainer's), else computed here from the model's gradients
                with fused ops.
        Raises:
            GiveUp: ``raise`` policy, no checkpoint to roll back to, rollback budget spent (exit 76).
            ValueError: a hook's ``on_instability`` returned an unknown action.
        """
        with self._edge():
            step = self.step + 1
            if self.rejoin.failure is not None:  # a peer was lost in this step: it is done again
                self.recovery.refuse()
                return False
            # this rank's step boundary, before the last collective (see rejoin.boundary), unless
            # DDP's backward kept it before its last bucket (rejoin.catch)
            if self.rejoin.keeping and self.rejoin.boundary.step != step:
                self.inprocess.keep_boundary(step)
            if self.faults.pending:
                self.faults.at(self.step, "should_step")
            if grad_norm is None:  # the norm the step's clip_grad_norm_ returned (the HF Trainer's), if any
                grad_norm = CATCH.step_norm()
            if self.faults.numeric_pending:
                loss, grad_norm = self.faults.numeric(step, loss, grad_norm, self.model)
            if ALIGN.open:  # after an in-process recovery: does this rank line up with the survivors?
                ALIGN.at(SHOULD_STEP, alone_ok=False)
            with self.recovering.recoverable("should_step", step) as lost:
                verdict = self.recovery.observe(step, loss, grad_norm)
                if self.reruns.pending(step):  # the re-run of an unstable step
                    action = self.sdc_response.rerun_verdict(loss, self.model, self.hosts)
                    if action is not None:
                        self.sdc_flow.act(action)
                        return False  # a persistent fault, acted on
                elif self.recovery.unstable(verdict) and self.reruns.wants(step):
                    # before any policy: the hardware or the data?
                    self.sdc_flow.act(self.sdc_response.rerun(verdict, loss, self.model))
                    return False
                decision = self.recovery.decide(verdict)
            if lost:
                self.recovery.refuse()
                return False
            if isinstance(decision, Rollback):
                self.rollbacks.roll_back(decision)
                return False
            return decision

    def recover_in_step(self) -> bool:
        """For a framework's loop, which cannot yield a step again: if a peer was lost in the step in
        progress before its update was applied, meet the lost rank's replacement now and return
        ``True``: the caller runs the step's forward and backward again, on the same batch (the
        random number generators and this rank's own state are back at the step's start), then
        calls :meth:`should_step` again and applies the update as usual. ``False``: no peer was
        lost (or the update was already applied: :meth:`step_end` recovers). A collective on the
        new group. Used by :mod:`trainguard.lightning` after :meth:`should_step` returned ``False``.

        Raises:
            RegroupError, the collective's error: the ranks cannot be recovered in-process (no new
                generation within ``[recovery] timeout``, DDP survivors one step apart: this rank
                exits and the launcher restarts the group; a sharded model rolls back to a snapshot
                instead).
        """
        if self.rejoin.failure is None or (self.step_start is not None and self.step_start.applied):
            return False
        with self._edge():
            self.recovering.recover(redo=True, take_completed=False)
        return True

    def catch_peers(self) -> None:
        """A replacement of a lost rank catches lost peers in the script's collectives from now on
        (by default from its first :meth:`step_begin`: the set-up collectives a framework runs after
        :meth:`begin` complete on it alone). For a framework whose first collective of a step
        comes before its step-begin callback (:mod:`trainguard.hf`: the token count's all-gather).
        Does nothing on other ranks."""
        self.recovering.catch_peers()

    def run_step(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        backward: Optional[Callable[[torch.Tensor], None]] = None,
    ) -> torch.Tensor:
        """Forward and backward of this step over micro-batches, recovering from out-of-memory::

            loss = guard.run_step(lambda mb: F.cross_entropy(model(mb[0]), mb[1]), (x, y))

        ``step_fn(micro_batch)`` runs the forward and returns the micro-batch's mean loss (0-dim);
        the Guard runs ``backward(loss × share of the batch)`` (default ``Tensor.backward``; pass
        e.g. ``lambda l: scaler.scale(l).backward()`` for AMP). Gradients must be zero (or ``None``)
        on entry. On out-of-memory on any rank every rank halves the micro-batch and retries the
        same batch (see :mod:`trainguard.oom` and ``[oom]``). A collective: call it on every rank.

        Args:
            batch: a tensor, or tuples/lists/dicts of tensors sharing their first (sample) dimension.
        Returns:
            The batch's loss (0-dim, detached).
        Raises:
            BadInput: a batch that cannot be split, a micro-batch size larger than the batch.
            GiveUp: out of memory at micro-batch size 1.
        """
        if self._ran_step is not None:
            self._ran_step = True
        with self._edge(), self.recovering.recoverable("run_step", self.step + 1):
            return self.micro.run(self.step + 1, step_fn, batch, backward)
        return torch.full((), float("nan"))  # a lost peer: the step is abandoned and done again

    def step_end(self, loss: Any = None) -> None:
        """Close the current step: count it, then check stop and save conditions (see module doc).

        Args:
            loss: the step's loss (tensor or float), kept as ``guard.last_loss`` and passed to hooks;
                it is not synchronized here.
        Raises:
            Requeue: a stop was agreed (after the checkpoint of this step).
            GiveUp: ``[checkpoint] max_failures`` saves in a row failed.
            PeerLostError: a peer stopped answering the liveness ping.
        """
        with self._edge():
            self._step_end(loss)
            # the first step after an in-process recovery: tell the launcher (the progress rule)
            self.inprocess.step_completed(self.step, self.rank, self.world_size)
        self.draws.boundary()

    def _step_end(self, loss: Any) -> None:
        self._awaiting_step_end = False
        if self._ran_step is not None:  # the first step: does this loop call run_step? (said once)
            self.inprocess.say_if_outside_run_step(self._ran_step)
            self._ran_step = None
        self.recovery.step_closed()
        if self.rejoin.failure is not None and not (self.step_start and self.step_start.applied):
            self.recovering.recover(redo=True)  # a peer was lost before this step's update: steps() yields it again
            self.world.rolled_back = True
        if self.world.rolled_back:  # the step was undone: steps() yields the checkpoint's step next
            self.world.rolled_back = False
            if self.heartbeat is not None:
                self.heartbeat.close_and_beat(self.step)
            return
        self.step += 1
        if self.faults.sdc_pending:  # a bit flips in a parameter, after the optimizer step
            self.faults.corrupt(self.step, self.model)
        now = time.perf_counter()
        self.stop_check.step_took(now - self._t_last)
        self.straggler.record_step(now - self._t_last)
        self._t_last = now
        self.last_loss = loss
        if self.rejoin.keeping and self.rejoin.boundary.step != self.step:  # a loop without should_step
            self.inprocess.keep_boundary(self.step)
        if self.rejoin.failure is not None:  # the update was applied before the lost peer surfaced
            self.recovering.after_update()  # (a logging all-reduce after optimizer.step()): the step is complete
            return
        if not self._snapshot():
            return
        if self.faults.pending:  # inside the step section: an injected hang is a hang mid-step
            self.faults.at(self.step, "step")
        if self.heartbeat is not None:
            self.heartbeat.close_and_beat(self.step)
        if self.ping is not None and self.ping.failed is not None:
            raise health.PeerLostError(self.ping.failed)
        for h in self.hooks:
            h.on_step_end(self, self.step, loss)
        if self.sdc_flow.replicas_differ():
            return  # rolled back: steps() yields the checkpoint's step next
        self.commits.saved(
            self.ckpt.poll()
        )  # finalize a background save that has finished (before its known-good verdict)
        if self.rank == 0:
            self.recovery.after_step(self.step)
        flags = self.stops.check(self.sdc_flow.stop) if self.stop_check.due(self.step) else StopFlags()
        if flags is None:  # the group changed in place: its newcomers start after this boundary, so do we
            return
        if flags.reason is not None:
            self.sdc_flow.stop(flags.reason)
        if flags.save_switch:
            self.save("save_switch")
            if self.rank == 0:
                self.stop.clear_save_switch()
        elif tiers := self.ckpt.due(self.step):
            self.save("interval", tiers, blocking=not self.ckpt.asynchronous)

    def _snapshot(self) -> bool:
        """A sharded model's in-memory snapshot at this boundary (:meth:`InProcess.snapshot`);
        ``False``: a peer was lost in its copy and the ranks rolled back in-process (the step
        counter is the snapshot's)."""
        with self.recovering.recoverable("snapshot") as lost:
            self.inprocess.snapshot(self.step)
        if lost:
            self.recovering.after_update()
        return not lost

    # ------------------------------------------------------------------------------------------
    # begin / end

    def _begin(self) -> None:
        if self.rejoin.joining:
            drawn = self.draws.before_loop()  # a replacement runs the script's start as a resume does
            self._t_last = self.recovering.join()
            if drawn:
                self.resumer.not_bitwise(self.step, DRAWN_BEFORE_LOOP, say=True)  # the replacement says it itself
            return
        kill = tgdist.all_reduce_max([int(self.stop.kill_switch())])[0]
        if kill:
            if self.rank == 0:
                path = str(self.stop.kill_path)
                self.events.emit("stop_requested", self.step, reason="kill_switch", before_training=True, path=path)
            raise Requeue("kill_switch", f"the kill switch {self.stop.kill_path} is set: not training")
        if self.rank == 0:
            dump_config(self.cfg, self.run_dir / "config.toml")
        # a host is its SLURM node name under SLURM (what --exclude and ExcNodeList take), else its hostname
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.inprocess.open_snapshots()  # a sharded model's snapshot copies: a group of their own
        ports = sever.listening_ports() if self.rejoin.active else []
        gathered = tgdist.gather_objects((host, ports))
        hosts = self.world.hosts = [h for h, _ in gathered]
        self.rejoin.group_ports = {p for _, ps in gathered for p in ps}  # cut on a lost peer (rejoin.sever)
        self.straggler.set_hosts(hosts)
        self.recovery.on_start()
        resumed = self.resumer.resume()
        if resumed is not None:
            self.step, self.resumed_from = resumed.step, resumed.checkpoint
            if resumed.persistent is not None:
                self.recovery.on_resume(resumed.persistent)
        self.sdc.last_good = self.step  # every replica loaded the same state
        if self.rejoin.keeping:
            self.inprocess.keep_boundary(self.step)
        self.inprocess.began(self.step)  # the launcher hears of the first completed step (the progress rule)
        self.inprocess.snapshot(self.step, now=True)  # a sharded model's first in-memory snapshot
        self.world.ping = health.start(
            self.cfg.health,
            self.store,
            self.cfg.checkpoint.keep_last,
            self.model,
            self.optimizer,
            self.events,
            self.step,
            hosts,
            self.rank,
            self.world_size,
            self._on_ping_failure,
        )
        if self.rank == 0:
            resumed_from = str(self.resumed_from.path) if self.resumed_from else None
            self.events.emit(
                "start",
                self.step,
                world_size=self.world_size,
                host=socket.gethostname(),
                first_step=self.step,
                resumed_from=resumed_from,
            )
            console.say(
                f"run {self.run_dir}: "
                + (
                    f"resumed at step {self.step} from {self.resumed_from.path}"
                    if self.resumed_from
                    else "fresh start (no checkpoint)"
                )
                + f", {self.world_size} rank(s)"
            )
        self._t_last = time.perf_counter()
        for h in self.hooks:
            h.on_train_begin(self)

    def _finish(self) -> None:
        self.inprocess.close_snapshots()
        if self.rejoin.failure is not None:  # lost after the last step's update (a framework's loop)
            self.recovering.recover(redo=False)
        self.sdc_flow.settle_pending()  # the last step's replica check: no next bucket carries it
        if self.cfg.checkpoint.save_final:
            self.save("final")
        self.commits.saved(self.ckpt.close())
        digest = state_hash(self.model, self.optimizer)
        loss = (
            float(self.last_loss.detach() if torch.is_tensor(self.last_loss) else self.last_loss)
            if self.last_loss is not None
            else None
        )
        if self.rank == 0:
            self.events.emit("end", self.step, state_sha256=digest, last_loss=loss)
            console.say(f"finished at step {self.step}; state sha256 {digest}")
        # leave together: a rank that tears its group down while a peer still finishes rank-0
        # work (the final commit) can make gloo abort in the peer at exit
        self.world.stop_ping()
        tgdist.barrier()
        enter_teardown(self.heartbeat)
        for h in self.hooks:
            h.on_train_end(self, "finished")
        self.state_sha256 = digest

    # ------------------------------------------------------------------------------------------
    # leaving: an outcome carried out once (self._edge), close

    def _leave(self, o: Outcome) -> None:
        """Carry out outcome ``o`` (once, from :class:`~.edge.Edge`): alone (bad input, a rank
        that withdraws) without waiting for a peer; else finish the save in flight, tell the hooks,
        write the ``exit`` event and leave together."""
        if isinstance(o, BadInput) or not o.collective:  # found on this rank only: no collective
            edge.announce(o, self.rank, self.step, self.events)
            if not isinstance(o, BadInput):
                enter_teardown(self.heartbeat)
            self._release(collective=False)
            if not isinstance(o, BadInput):  # the others carry on without this rank
                tgdist.destroy()  # a gloo group torn down during interpreter exit can abort the process
            return
        if self.commits is not None:
            self.commits.wait()
        for h in self.hooks:
            h.on_train_end(self, o.reason)
        edge.announce(o, self.rank, self.step, self.events)
        enter_teardown(self.heartbeat)
        gc.freeze()  # skip the final collection over torch objects at exit (measured: 0.6 s → 0.1 s)
        self.world.stop_ping()
        tgdist.barrier()  # leave together, then tear the default group down before the interpreter exits
        self.close()
        tgdist.destroy()

    def close(self) -> None:
        """Release everything the Guard installed: finish a save in flight, stop the liveness ping
        (agreeing with the other ranks: call ``close`` on every rank, as the loop does) and the
        checkpoint threads, destroy their process groups, remove optimizer and gradient hooks,
        restore the previous signal handlers, unmap the heartbeat record, close the event log.
        Safe to call twice; ``with Guard(...) as guard:`` calls it."""
        console.restore_excepthook()  # also after a failure's release, which keeps it for the error
        if self._closed:
            return
        self._closed = True
        if self.commits is not None:  # (built after the checkpointer)
            self.commits.saved(self.ckpt.close())
        self.world.stop_ping()
        self._release(collective=True)

    def _release(self, collective: bool) -> None:
        """The local part of closing (no collective): hooks, signal handlers, threads that need no
        peer, heartbeat, event log. ``collective=False`` (a failure on this rank alone) does not
        wait for a background save, which may be waiting for peers."""
        self._closed = True
        if self.ckpt is not None:
            self.ckpt.close(wait=collective)
        for part in (self.recovery, self.micro, self.faults, self.step_inputs, self.step_start):
            if part is not None:
                part.close()
        if self.shutdown is not None:
            self.shutdown.close()
        detach_supervisor(self.heartbeat)
        self.heartbeat = None
        CATCH.uninstall()
        ALIGN.close()
        if self.inprocess is not None:
            self.inprocess.close()
        if self.rejoin is not None and collective:  # a rank that fails alone leaves its state to its replacement
            self.rejoin.close()
        elif self.rejoin is not None:
            self.rejoin.stop_watching()
        if self.events is not None:
            self.events.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None or (isinstance(exc, Outcome) and exc.collective):
            self.close()
        else:  # a crash: the peers may not come to a collective
            self.abandon()

    def abandon(self) -> None:
        """After a crash on this rank (an error that is not a trainguard outcome): release what the
        Guard installed without a collective (the peers may not come to one) and without waiting
        for a background save. :meth:`close` afterwards puts back ``sys.excepthook`` (kept for the
        error on its way out)."""
        self._release(collective=False)

    # ------------------------------------------------------------------------------------------
    # saving and stopping (self.stops)

    def rank_state(self) -> dict[str, Any]:
        """This rank's non-tensor training state: ``{"step": ..., **train_state}`` (scheduler, data
        position, extras, instability statistics and learning-rate ramp, micro-batch size, RNG)."""
        return self.stops.rank_state()

    def save(
        self, reason: str = "manual", tiers: tuple[str, ...] = ("persistent",), blocking: bool = True
    ) -> Optional[Checkpoint]:
        """Save a checkpoint of the current step (a collective: call on every rank).

        Does nothing for a tier that already holds this step. A failed write is recorded as a
        ``checkpoint_failed`` event and a warning; the older checkpoints stay valid.

        Args:
            tiers: ``"persistent"`` and/or ``"local"``.
            blocking: ``False`` with ``[checkpoint] async_save``: return once the state is copied
                to host memory; the write and commit finish in the background.
        Returns:
            The committed persistent checkpoint of a blocking save, else ``None``.
        Raises:
            GiveUp: ``[checkpoint] max_failures`` failures in a row (exit 76).
        """
        with self._edge():
            return self.stops.save(reason, tiers, blocking)

    def _on_ping_failure(self, why: str) -> None:
        # with in-process recovery the main thread may be waiting for the replacement: give it that long
        grace = PING_FAILURE_GRACE + (self.cfg.recovery.timeout if self.rejoin.active else 0.0)
        self.shutdown.deadline_timer.arm(grace, health.PING_FAILED_EXIT)

    def _ask_hooks(self, event: dict) -> list[Optional[str]]:
        return [h.on_instability(self, dict(event)) for h in self.hooks]

    def _on_deadline(self) -> None:
        self.events.emit(
            "deadline_exit", self.step, deadline=self.cfg.preemption.save_deadline, signal=self.shutdown.received
        )
