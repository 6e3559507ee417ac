"""A step abandoned because a peer was lost changes nothing: the update is not applied, and the
scheduler and the optimizer's hyperparameters come back to the step's start.

A loop without ``guard.should_step`` calls ``optimizer.step()`` and ``scheduler.step()`` whatever
happened in the step. When a peer was lost in the step's collectives (caught by
:mod:`trainguard.rejoin.catch`), the gradients are this rank's own, not the group's: the
optimizer pre-hook drops them (``grad = None``), so that torch's optimizers leave every parameter
and its optimizer state alone. ``scheduler.step()`` still runs and sets the learning rate in the
optimizer's parameter groups for the next step; :meth:`StepStart.restore` puts both back as they
were when the step began, and the step is done again after the recovery.

A step whose update was applied before the failure surfaced (a logging all-reduce after
``optimizer.step()``) is complete: :attr:`StepStart.applied` tells the Guard so, and nothing is
redone.

Schedulers the Guard was not given (a loop that builds its ``LambdaLR`` from the step it resumed
at, after ``next(guard.steps())``) are found at the first :data:`LOOK_BEGINS` step beginnings
through the garbage collector's referrers of the optimizer (about 50 ms each with 300,000 Python
objects alive: three times a run), and kept and put back alike. They are not checkpointed: a
replacement or a restart builds them as the script does, and the loop check
(:mod:`.loop_check`) compares the learning rate they set.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from typing import Any, Callable, Optional

import torch

# step beginnings at which the optimizer's other schedulers are looked for (a scheduler built after
# the resume's first ``next(guard.steps())`` exists at the second)
LOOK_BEGINS = 3


class StepStart:
    """The optimizer's and the scheduler's state at the start of the current step, and whether the
    step's update was applied.

    Args:
        optimizer: the script's optimizer (``None``: nothing to watch; every failed step is redone).
        scheduler: its learning-rate scheduler, if any (any object with ``state_dict``).
        failed: ``() -> bool``, whether a peer was lost in the current step.
    """

    def __init__(self, optimizer: Optional[torch.optim.Optimizer], scheduler: Any, failed: Callable[[], bool]):
        self.optimizer, self.scheduler, self.failed = optimizer, scheduler, failed
        self.applied = False  # optimizer.step() ran in this step with the group's gradients
        self.refused = False  # should_step() told the loop not to update in this step (a peer was lost)
        self._groups: list[dict[str, Any]] = []
        self._scheduler: Optional[dict[str, Any]] = None
        self._found: list[weakref.ref] = []  # the optimizer's schedulers the Guard was not given
        self._kept_found: list[tuple[weakref.ref, dict[str, Any]]] = []
        self._begins = 0
        self._also: list[Any] = []  # more of the step's start: objects with new_step() and restore()
        self._hooks = []
        if optimizer is not None:
            self._hooks = [
                optimizer.register_step_pre_hook(self._drop_failed_update),
                optimizer.register_step_post_hook(self._after_step),
            ]

    def also(self, part: Any) -> None:
        """Keep and restore ``part`` with the step's start too (``part.new_step()`` at
        :meth:`step_begin`, ``part.restore()`` at :meth:`restore`): a DDP model's buffers
        (:class:`~trainguard.rejoin.buffers.BufferSync`)."""
        self._also.append(part)

    def step_begin(self, step: int) -> None:
        """Step ``step`` begins (the Guard's component protocol): keep the hyperparameters (``lr``, ``betas``, ...: every parameter-group
        entry but the parameters) and the scheduler's state. About 20 µs for one group."""
        self.applied = self.refused = False
        for part in self._also:
            part.new_step()
        if self.optimizer is not None:
            self._groups = [
                {k: copy.copy(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ]
        if self.scheduler is not None:
            self._scheduler = _copy(self.scheduler.state_dict())
        self._begins += 1
        if self._begins <= LOOK_BEGINS and self.optimizer is not None:
            known = self.kept()
            self._found += [weakref.ref(s) for s in _schedulers_of(self.optimizer) if not any(s is k for k in known)]
        self._kept_found = [(ref, _copy(s.state_dict())) for ref in self._found if (s := ref()) is not None]

    def unguarded_update(self) -> Optional[str]:
        """Why the interrupted step's update may have been applied on this rank with its own
        gradients, ``None`` when it cannot have been: without an optimizer given to the Guard (whose
        pre-hook drops the update) a loop updates the parameters itself (``p.data.add_(...)``),
        and only a ``should_step()`` that told it not to (``False`` in this step) keeps the
        parameters as the step found them; the Guard cannot put them back (issue 52)."""
        if self.optimizer is not None or self.refused:
            return None
        return (
            "the Guard was given no optimizer and the loop did not ask should_step() in the interrupted step, so "
            "its own update may have changed the parameters with this rank's gradients alone (pass "
            "Guard(optimizer=...), or update only `if guard.should_step(loss):`)"
        )

    def kept(self) -> list[Any]:
        """The schedulers whose state this step start keeps: the Guard's and those found."""
        found = [s for ref in self._found if (s := ref()) is not None]
        return ([self.scheduler] if self.scheduler is not None else []) + found

    def restore(self) -> None:
        """Put the hyperparameters and the scheduler back as :meth:`step_begin` found them."""
        if self.optimizer is not None:
            for group, kept in zip(self.optimizer.param_groups, self._groups):
                group.update(kept)
        if self.scheduler is not None and self._scheduler is not None:
            self.scheduler.load_state_dict(_copy(self._scheduler))
        for ref, state in self._kept_found:
            s = ref()
            if s is not None:
                s.load_state_dict(_copy(state))
        for part in self._also:
            part.restore()

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _drop_failed_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.failed():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.applied = self.applied or not self.failed()


def _schedulers_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The learning-rate schedulers stepping ``optimizer``, found through the garbage collector's
    referrers of it and of the instance dictionaries among them (an object whose ``__dict__`` was
    made, by ``state_dict()`` for one, is referred to through it): two passes over the live objects,
    about 25 ms each with 300,000 of them, so not every step."""
    direct = gc.get_referrers(optimizer)
    dicts = [d for d in direct if type(d) is dict]
    owners = gc.get_referrers(*dicts) if dicts else []
    found: list[Any] = []
    for o in direct + owners:
        if isinstance(o, torch.optim.lr_scheduler.LRScheduler) and o.optimizer is optimizer:
            if not any(o is f for f in found):
                found.append(o)
    return found


def schedulers_not_kept(optimizer: Optional[torch.optim.Optimizer], kept: list[Any]) -> list[str]:
    """The learning-rate schedulers of ``optimizer`` not in ``kept`` (:meth:`StepStart.kept`): a
    step done again steps them twice (their state is neither saved nor put back), so the run
    cannot stay bitwise. Their class names. Call it at a recovery, not every step."""
    if optimizer is None:
        return []
    return sorted(type(o).__name__ for o in _schedulers_of(optimizer) if not any(o is k for k in kept))


def _copy(state: Any) -> Any:
    """A deep copy of a scheduler's state: through pickle (half of ``copy.deepcopy``'s time for a
    small dict of numbers and lists), or ``copy.deepcopy`` where pickle cannot (a lambda in it)."""
    try:
        return pickle.loads(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 (any object pickle refuses: a local function, a lock...)
        return copy.deepcopy(state)
