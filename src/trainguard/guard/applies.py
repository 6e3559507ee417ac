"""Whether in-process recovery applies to a run (:mod:`trainguard.rejoin`): the backend's policy
(:mod:`~trainguard.rejoin.backend_policy`), a framework that owns the loop, a model that cannot be
moved to a new group, a data position a replacement cannot take back; and rank 0's line at the start
when it does not apply.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import compat, console
from .. import dist as tgdist
from ..rejoin import abort, backend_policy, regroup
from ..rejoin.rank import Rejoin
from ..state import datapos


def recovery_policy(in_process: backend_policy.InProcessValue) -> backend_policy.BackendPolicy:
    """The recovery for this job's default group under ``[recovery] in_process``
    (:func:`~trainguard.rejoin.backend_policy.decide`); the abort path declined where the
    installed torch lacks a member it uses (:func:`~trainguard.rejoin.abort.why_unsupported`)."""
    policy = backend_policy.decide(tgdist.backend(), in_process)
    why = abort.why_unsupported(tgdist.backend()) if policy.abort else None
    return replace(policy, in_process=False, abort=False, declined=why) if why else policy


STATEFUL_LOADER = (
    "the data position is a StatefulDataLoader's: a replacement cannot take it back to the interrupted step's "
    "start (measured: an epoch loop over one recovered with other weights than an uninterrupted run's)"
)


def rolls_forward(roll_forward: bool, framework: Optional[str], model: torch.nn.Module) -> bool:
    """Whether ``[recovery] roll_forward`` (``roll_forward``) can apply to this loop, as far as
    the start can tell (:mod:`~trainguard.rejoin.forward`): the script's own loop over a DDP model
    with no communication hook of the script's own, and a torch that shows the autograd engine's
    final callbacks, on gloo (on NCCL the meeting would run in a callback of a CUDA backward's
    device thread, with communicators aborted: not verified). (The Guard's build decides for good,
    with its DDP hook installed.)"""
    if not roll_forward or framework is not None or not isinstance(model, DDP) or tgdist.backend() != "gloo":
        return False
    hooks = compat.ddp_comm_hooks(model)
    return hooks is not None and not hooks and compat.backward_engine() is not None


def declined(
    framework: Optional[str],
    model: torch.nn.Module,
    policy: Optional[backend_policy.BackendPolicy] = None,
    sampler: Any = None,
    rolls: bool = False,
) -> Optional[str]:
    """Why in-process recovery does not apply to this loop, ``None`` if it does: a framework
    drives it, the backend's ``policy`` declines it (:func:`recovery_policy`: NCCL by default), the
    Guard's ``sampler`` is a loader that keeps its own position (torchdata's ``StatefulDataLoader``:
    :data:`STATEFUL_LOADER`; its resume from a checkpoint is bitwise, tests/test_loops.py) unless
    the step rolls forward (``rolls``: :func:`rolls_forward`; the survivors' loader is not taken
    back, the replacement's resumes from the lost rank's boundary, and a loss that would be done
    again restarts the group instead: :meth:`~.inprocess.InProcess.recover`), or the model cannot
    be moved to a new group (:func:`~trainguard.rejoin.regroup.check_rebindable`)."""
    if framework is not None:
        return f"{framework} owns the process group and the training loop"
    if policy is not None and policy.declined is not None:
        return policy.declined
    if datapos.stateful_loaders([sampler]) and not rolls:
        return STATEFUL_LOADER
    try:
        regroup.check_rebindable(model)
    except regroup.RegroupError as e:
        return str(e)
    return None


def say_where_it_applies(
    rejoin: Rejoin, in_process: bool, recovery_store: Optional[str], world_size: int, has_optimizer: bool = True
) -> None:
    """Rank 0, once at start: why in-process recovery (on by default) does not apply, if it does
    not; and, for a loop whose optimizer the Guard was not given (``has_optimizer``), when it does."""
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
    elif rejoin.active and world_size > 1 and not has_optimizer:
        console.say(
            "the Guard was given no optimizer: a rank lost in a step is recovered in-process only where the loop "
            "asked should_step() before its own update in that step (else the group restarts); pass "
            "Guard(optimizer=...) or update only `if guard.should_step(loss):`"
        )
