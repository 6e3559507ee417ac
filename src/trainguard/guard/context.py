"""What every part of one Guard shares (:class:`Context`), what the script handed the Guard
(:class:`Script`), and the small protocol the parts implement (:class:`Component`).

A part's constructor takes the :class:`Context` and then only the other parts it acts on, so a
reader sees at the call what a part can touch. The context holds the run's fixed facts and the
services no part decides about (the config, the shared view of where this rank stands, the
script's objects, the event log, the hang supervisor's sections, the injected faults); it holds
no part that makes a decision.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch

from ..config import Config
from ..events import EventLog, Hook
from ..faults import FaultInjector
from .world import World


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


@dataclass(frozen=True)
class Context:
    """What every part of one Guard shares; made once by :func:`.build.build`.

    Attributes:
        cfg: the run's validated config (a part reads its own sections).
        world: where this rank stands (rank, world size, hosts, completed steps; mutable, one object).
        script: the script's objects (:class:`Script`).
        events: the run's event log.
        section: ``section(name)``, the hang supervisor's named section (``guard.section``).
        owner: the Guard, as the script's hooks receive it.
        faults: the injected faults (``[faults] inject``; nothing pending in a real run).
    """

    cfg: Config
    world: World
    script: Script
    events: EventLog
    section: Callable[[str], contextlib.AbstractContextManager[None]]
    owner: Any
    faults: FaultInjector

    def in_progress(self) -> int:
        """The number of the step being run (1-based: ``guard.step + 1``)."""
        return self.world.step + 1

    def tell_hooks(self, name: str, *args: Any) -> list[Any]:
        """Call hook method ``name(owner, *args)`` on each of the script's hooks, in order; their answers."""
        return [getattr(h, name)(self.owner, *args) for h in self.script.hooks]


class Component(Protocol):
    """The protocol of the Guard's parts, each method optional: a part registered with
    :meth:`.parts.Parts.add` is called at the points it defines, in the order the parts were
    registered, and closed in the reverse order. Step numbers are 1-based (step ``n`` is the
    ``n``-th optimizer step); ``completed`` counts completed steps (``guard.step``).

    - ``begin(completed)``: training starts after ``completed`` steps (a resume, a fresh start or
      a replacement's join), once per :meth:`~.guard.Guard.begin`.
    - ``step_begin(step)``: step ``step`` opens (``guard.step_begin``).
    - ``should_step(step)``: the update's check of step ``step`` begins (``guard.should_step``,
      before the instability detectors; not called when a lost peer already undid the step).
    - ``step_end(step)``: ``guard.step_end`` of step ``step`` was called, before the Guard counts
      it or decides anything at the boundary.
    - ``close()``: the Guard releases what it built (:meth:`.parts.Parts.release`).
    """

    def begin(self, completed: int) -> None: ...
    def step_begin(self, step: int) -> None: ...
    def should_step(self, step: int) -> None: ...
    def step_end(self, step: int) -> None: ...
    def close(self) -> None: ...


HOOKS = ("begin", "step_begin", "should_step", "step_end")  # the protocol's points, besides close
