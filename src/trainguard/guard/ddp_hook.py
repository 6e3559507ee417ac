"""trainguard's communication hook on a DDP model (:class:`~trainguard.rejoin.catch.DDPHook`): where
the detectors' values ride (:mod:`trainguard.instability.fold`), where a lost peer is caught in the
gradient all-reduce and where the step boundary is kept before the last bucket, composed with a
communication hook of the script's own.

A component of :class:`~trainguard.guard.Guard`, made before the training state (whose saved bucket
layout, :class:`~trainguard.state.buckets.BucketLayout`, reads :meth:`DDPCommHook.layout`) and
installed on the model once the parts that ride in it exist.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat, console
from ..instability.fold import LossFold
from ..rejoin.buffers import BufferSync, has_buffers
from ..rejoin.catch import Catch, DDPHook, is_own_hook
from ..rejoin.forward import RollForward
from ..rejoin.rank import Rejoin
from ..rejoin.stepstart import StepStart


def spans_world(group: Any) -> bool:
    """Whether the process group ``group`` (a DDP model's ``process_group``) has every rank of the
    default group."""
    return group.size() == dist.get_world_size()


class DDPCommHook:
    """trainguard's DDP communication hook on ``model``, once :meth:`install` registered it.

    Args:
        model: the script's model (only a DDP model gets the hook).
        rejoin: this rank's recovery state (active: the step's buffers are kept for a redo; its
            rank: rank 0 says once that a script's own hook reduces the gradients).

    Attributes:
        hook: trainguard's hook (``None`` before :meth:`install`, or for good: not a DDP model).
        buffer_sync: DDP's buffer broadcast where a lost peer is caught (``None``: none).
    """

    def __init__(self, model: torch.nn.Module, rejoin: Rejoin, catch: Catch):
        self.model, self.rejoin, self.catch = model, rejoin, catch
        self.hook: Optional[DDPHook] = None
        self.buffer_sync: Optional[BufferSync] = None

    def layout(self) -> Optional[list[list[int]]]:
        """DDP's current bucket layout, as trainguard's hook last saw it (``None`` without it)."""
        return self.hook.layout if self.hook is not None and self.hook.layout else None

    def install(
        self,
        step_in_progress: Callable[[], int],
        fold: LossFold,
        before_last_bucket: Callable[[int], None],
        step_start: Optional[StepStart],
        inject: Optional[Callable[[], tuple[float, float]]] = None,
    ) -> bool:
        """Give a DDP model trainguard's communication hook (:class:`~trainguard.rejoin.catch.DDPHook`):
        it carries ``fold``'s values in one bucket (:mod:`~trainguard.instability.fold`;
        ``inject``: the fault injector's numeric faults at the backward), calls
        ``before_last_bucket(step)`` before the last bucket of each step is sent (the step boundary
        is kept there), and catches a lost peer once :meth:`InProcess.arm_catch` ran. With
        in-process recovery a model with buffers gets :class:`~trainguard.rejoin.buffers.BufferSync`
        too, restored by ``step_start`` with the step's state for a redo.

        A hook of the script's own composes with it: one registered before the Guard is taken over
        (the reducer is built again, as :func:`~trainguard.rejoin.regroup.rebind_ddp` builds it,
        with trainguard's hook, which calls the script's); one registered after it
        (``model.register_comm_hook``, intercepted on this instance until :meth:`close`) is called
        by trainguard's from the next backward on. Either way the detectors' values no longer ride
        in the buckets (``should_step`` all-reduces them) and rank 0 says so once.

        The hook averages each bucket over the model's own process group (DDP's
        ``process_group``), as DDP's default hook does; the detectors' values ride in a bucket only
        where that group spans every rank (their sums are taken over every rank).

        Returns whether ``fold``'s values ride in the buckets (:meth:`LossFold.wire` ran). ``False``
        and nothing done: not a DDP model, torch does not list its hooks, or it has trainguard's
        hook already (an earlier Guard's on the same model: DDP takes one); ``False`` with the hook
        installed: the model's group is a part of the ranks."""
        params = compat.ddp_reducer_params(self.model) if isinstance(self.model, DDP) else None
        hooks = compat.ddp_comm_hooks(self.model) if params is not None else None  # compat: None where torch lacks it
        if params is None or hooks is None or any(is_own_hook(h) for h, _ in hooks) or len(hooks) > 1:
            return False
        group = self.model.process_group
        carries = spans_world(group)  # the detectors' values are summed over every rank, or not carried
        self.hook = hooked = DDPHook(
            self.catch,
            params,
            lambda: before_last_bucket(step_in_progress()),
            (lambda buf: fold.extra(step_in_progress(), buf)) if carries else None,
            lambda values: fold.reduced(step_in_progress(), values),
            group=lambda: self.model.process_group,  # read at each bucket: a recovery gives DDP a new group
        )
        if hooks:  # the script's, registered before the Guard: trainguard's calls it
            hook, state = hooks[0]
            compat.clear_comm_hooks(self.model)
            compat.rebuild_reducer(self.model)
            self._delegate(hook, state)
        self.model.register_comm_hook(None, hooked.hook)
        self.model.register_comm_hook = self._script_hook  # an instance attribute: removed at close()
        if self.rejoin.active and has_buffers(self.model):  # a redo starts from the step's buffers
            self.buffer_sync = BufferSync(self.model, self.catch)
            if step_start is not None:
                step_start.also(self.buffer_sync)
        if carries:
            fold.wire(inject)
        elif self.rejoin.rank == 0:
            console.say(
                f"the model's DDP trains on a process group of {group.size()} of {dist.get_world_size()} ranks: "
                "its gradients are averaged over that group as DDP does; the instability detectors' values, "
                "summed over every rank, do not ride in its buckets (should_step() all-reduces them)"
            )
        return carries

    def progress(self) -> tuple[int, int]:
        """trainguard's hook's progress in noting the layout (:meth:`DDPHook.progress`; ``(0, 0)``
        without the hook)."""
        return self.hook.progress() if self.hook is not None else (0, 0)

    def resume(self, progress: tuple[int, int], layout: Optional[list[list[int]]]) -> None:
        """Stand where another rank's hook stood, with its layout (:meth:`DDPHook.resume`);
        nothing without the hook."""
        if self.hook is not None:
            self.hook.resume(progress, layout)

    def roll_forward(
        self, step_in_progress: Callable[[], int], failed_during: Callable[[], Optional[str]]
    ) -> Optional[RollForward]:
        """Roll a lost peer's step forward at the end of its backward pass
        (:mod:`~trainguard.rejoin.forward`): the hook keeps each bucket's input from now on.
        ``None`` and nothing done: trainguard's hook is not installed or the script's own hook
        reduces the buckets (their inputs are not trainguard's to send again)."""
        if self.hook is None or self.hook.delegate is not None:
            return None
        hooked = self.hook
        forward = hooked.forward = RollForward(step_in_progress, failed_during, hooked.group, hooked.reduced)
        if self.buffer_sync is not None:  # a loss in the forward's broadcast of the buffers is met there
            self.buffer_sync.forward = forward
        return forward

    def _script_hook(self, state: Any, hook: Callable) -> None:
        """``model.register_comm_hook(state, hook)`` called by the script after the Guard: trainguard's
        hook calls ``hook`` from the next backward on (DDP takes one hook per model)."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: the hook must be callable, got {type(hook).__name__}")
        if self.hook.delegate is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once")
        self._delegate(hook, state)

    def _delegate(self, hook: Callable, state: Any) -> None:
        self.hook.delegate = (hook, state)
        if self.hook.forward is not None:  # registered after the Guard: its buckets are not ours to send again
            self.hook.forward = None
            if self.buffer_sync is not None:
                self.buffer_sync.forward = None
            if self.rejoin.rank == 0:
                console.say(
                    "[recovery] roll_forward no longer applies: the script's own DDP communication hook reduces "
                    "the buckets; a lost peer's step is done again"
                )
        if self.rejoin.rank == 0:
            name = getattr(hook, "__qualname__", type(hook).__name__)
            console.say(
                f"the script's DDP communication hook {name} reduces the gradients, called from trainguard's "
                "(a lost peer is caught in it); the instability detectors' values no longer ride in its "
                "buckets: should_step() all-reduces them (one small all-reduce a step)"
            )

    def close(self) -> None:
        """Give the model back as the Guard found it: DDP's buffer broadcast, the interception of
        ``register_comm_hook``, and the reducer: built again without trainguard's hook (DDP
        takes no hook away), with the bucket layout it had (so the sums round as before) and the
        script's own hook registered again if it had one; after it nothing of trainguard's runs
        in the model's backward. Safe to call twice."""
        if self.buffer_sync is not None:
            self.buffer_sync.close()
            self.buffer_sync = None
        vars(self.model).pop("register_comm_hook", None)
        hooked, self.hook = self.hook, None
        hooks = compat.ddp_comm_hooks(self.model) if hooked is not None else None
        if not hooks or not any(is_own_hook(h) for h, _ in hooks):
            return
        compat.clear_comm_hooks(self.model)
        compat.rebuild_reducer(self.model, hooked.layout or None)
        if hooked.delegate is not None:
            hook, state = hooked.delegate
            self.model.register_comm_hook(state, hook)
