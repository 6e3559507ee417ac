"""The Guard's parts (:class:`Parts`): a registry of components (:class:`~.context.Component`).

Each part is registered as soon as it is built (:meth:`Parts.add`, by :func:`~.build.build`): the
points of the component protocol it defines are called in registration order (:meth:`Parts.call`),
and what it holds to give back (a thread, a signal handler, a wrapper, a hook, a file) goes on the
parts' exit stack, which :meth:`Parts.release` closes in the reverse order. The Guard holds its
:class:`Parts` before :func:`~.build.build` fills it in, so a failure part-way (bad input found
after the checkpointer and the signal handlers exist) releases exactly what was built, by the same
structure.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, TypeVar

from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.store import CheckpointStore
from ..events import EventLog
from ..faults import FaultInjector
from ..health.straggler import StragglerDetector
from ..instability.fold import LossFold
from ..instability.recovery import Recovery
from ..oom import MicroBatcher
from ..rejoin.catch import Catch
from ..rejoin.rank import Rejoin
from ..rejoin.stepstart import StepStart
from ..sdc.crosscheck import StepInputs
from ..sdc.replicas import ReplicaCheck
from ..sdc.rerun import StepRerun
from ..state.fidelity import DrawWatch, ResumeFidelity
from ..state.reshard import ElasticState
from ..state.trainstate import TrainState
from ..stop.conditions import StopConditions
from ..stop.signals import ShutdownHandler
from ..supervisor.rank import detach as detach_supervisor
from .boundary import Boundary
from .context import HOOKS
from .ddp_hook import DDPCommHook
from .inprocess import InProcess
from .jit_save import JitSave
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

T = TypeVar("T")


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
        keeper: keeps this rank's own state at a step boundary. ddp: trainguard's DDP hook.
        jit: this rank's just-in-time save of the last completed step (``None``: off, see :mod:`.jit_save`).
        stack: what :meth:`release` gives back, in the reverse order of registering (:meth:`add`).
        collective: how :meth:`release` was called (read by the closers registered on the stack).
        points: for each point of the component protocol (:data:`.context.HOOKS`), the parts'
            methods called there, in the order the parts were registered (:meth:`add`).
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
    keeper: Optional[Keeper] = None
    ddp: Optional[DDPCommHook] = None
    jit: Optional[JitSave] = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    collective: bool = True
    points: dict[str, list[Callable[[int], None]]] = field(default_factory=lambda: {h: [] for h in HOOKS})

    def add(self, part: T, close: Optional[Callable[[], Any]] = None) -> T:
        """Register ``part`` (a :class:`~.context.Component`) as soon as it is built: the protocol's
        points it defines are called in registration order (:meth:`call`); ``close`` (default: its
        own ``close()``, if any) runs at :meth:`release`, before everything registered earlier.
        Returns ``part``.

        Raises:
            TypeError: a method of the protocol's name that does not take one step number.
        """
        for point in HOOKS:
            method = getattr(part, point, None)
            if method is None:
                continue
            if len(inspect.signature(method).parameters) != 1:
                raise TypeError(f"{type(part).__name__}.{point} must take one step number (the component protocol)")
            self.points[point].append(method)
        closer = close if close is not None else getattr(part, "close", None)
        if closer is not None:
            self.stack.callback(closer)
        return part

    def on_release(self, close: Callable[[], Any]) -> None:
        """Register ``close()`` alone (no part) to run at :meth:`release`, before everything registered earlier."""
        self.stack.callback(close)

    def call(self, point: str, step: int) -> None:
        """Call every registered part's ``point`` (``"begin"``, ``"step_begin"``, ``"should_step"``,
        ``"step_end"``) with ``step``, in registration order."""
        for method in self.points[point]:
            method(step)

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


_NOT_PARTS = ("stack", "collective", "points")
NAMES = tuple(f.name for f in fields(Parts) if f.name not in _NOT_PARTS)  # the parts (guard.ckpt, ...)
