"""A framework's wrappers given to ``Guard(...)``: unwrapped, or refused naming what to pass.

Lightning Fabric and Hugging Face accelerate hand the script wrappers of its model, optimizer,
scheduler and data loaders (``fabric.setup``, ``accelerator.prepare``). The Guard saves and
restores the objects that hold the state, and hooks the ones that do the work, so it takes what
is inside:

* Fabric's ``_FabricModule``: the module it runs (``DistributedDataParallel``, FSDP or the plain
  module). Its own ``state_dict()`` is the inner module's while torch's load looks the parameters
  up through the wrapper, so its checkpoints would not load (:mod:`trainguard.checkpoint.loadable`).
  Fabric's ``_FabricOptimizer``: its ``optimizer``. accelerate's ``AcceleratedOptimizer`` and
  ``AcceleratedScheduler``: their ``optimizer`` and ``scheduler`` (the wrapped optimizer's ``step``
  calls the inner one's, where the Guard's hooks are).
* Refused (:class:`~trainguard.outcomes.BadInput`, exit 2): a data loader as ``sampler`` that has
  no position to save (Fabric's, accelerate's unless it is stateful), any other ``sampler`` without
  ``state_dict``/``load_state_dict`` (a torch ``DataLoader``, ``RandomSampler``,
  ``DistributedSampler``: their position is not theirs to give), and a Fabric module compiled
  after ``setup`` (the module inside it is not reachable without torch's private names).

A Fabric loop gets the group restart for a lost rank, not in-process recovery (``framework``):
the restart resumed it bitwise where an in-process replacement did not (one trial, not yet
understood, and nothing said it).

:func:`unwrap` is called once, first thing in ``Guard.__init__``. Nothing is imported here:
objects of a framework that the script did not import cannot be its wrappers.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from .. import compat, console
from ..outcomes import BadInput

FABRIC = "Lightning Fabric"  # the framework named to the Guard (in-process recovery declined)
FABRIC_SAMPLER = (
    "pass the object that holds the data position instead: a trainguard.ResumableSampler given to the "
    "DataLoader as its sampler, set up with fabric.setup_dataloaders(loader, use_distributed_sampler=False) "
    "(docs/fabric.md)"
)
TORCH_SAMPLER = (
    "pass the object that holds the data position instead: a trainguard.ResumableSampler (given to the "
    "DataLoader as its sampler), or torchdata's StatefulDataLoader (the loader itself)"
)
ACCELERATE_SAMPLER = (
    "pass the object that holds the data position instead: a trainguard.ResumableSampler given to a train "
    "DataLoader left out of accelerator.prepare, or a loader prepared with "
    "Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))"
)


def _accelerate(module: str, name: str) -> Optional[type]:
    """accelerate's public class ``module.name`` if the script imported it, else ``None``."""
    mod = sys.modules.get(f"accelerate.{module}")
    cls = getattr(mod, name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def _model(model: Any) -> Any:
    kind = compat.fabric_kind(model)
    if kind == "module":
        inner = compat.fabric_forward_module(model)
        if inner is None:
            raise BadInput(
                f"model=: a module set up by Lightning Fabric ({type(model).__name__}) whose inner module this "
                f"Lightning ({compat.version('lightning')}) does not show: give the Guard the module Fabric runs"
            )
        return inner
    if kind is not None:
        raise BadInput(
            f"model=: {type(model).__name__} was made by Lightning Fabric (a module compiled after fabric.setup?): "
            "give the Guard the module itself (compile it before fabric.setup, or give the Guard the module you "
            "passed to fabric.setup with the strategy's wrapper: see docs/fabric.md)"
        )
    return model


def _optimizer(optimizer: Any) -> Any:
    if compat.fabric_kind(optimizer) == "optimizer":
        return optimizer.optimizer
    accelerated = _accelerate("optimizer", "AcceleratedOptimizer")
    if accelerated is not None and isinstance(optimizer, accelerated):
        return optimizer.optimizer
    return optimizer


def _scheduler(scheduler: Any) -> Any:
    accelerated = _accelerate("scheduler", "AcceleratedScheduler")
    if accelerated is not None and isinstance(scheduler, accelerated):
        return scheduler.scheduler
    return scheduler


def _sampler(sampler: Any) -> Any:
    if compat.fabric_kind(sampler) == "dataloader":
        raise BadInput(f"sampler=: a data loader set up by Lightning Fabric has no position to save; {FABRIC_SAMPLER}")
    for name in ("DataLoaderShard", "DataLoaderDispatcher"):
        cls = _accelerate("data_loader", name)
        if cls is not None and isinstance(sampler, cls) and not getattr(sampler, "use_stateful_dataloader", False):
            raise BadInput(
                f"sampler=: accelerate's {name} (from accelerator.prepare) keeps no position without "
                f"use_stateful_dataloader; {ACCELERATE_SAMPLER}"
            )
    if sampler is not None and not (
        callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None))
    ):
        raise BadInput(
            f"sampler=: {type(sampler).__name__} has no state_dict()/load_state_dict(), so its position cannot be "
            f"saved; {TORCH_SAMPLER}"
        )
    return sampler


def unwrap(
    model: Any, optimizer: Any, scheduler: Any, sampler: Any, framework: Optional[str] = None
) -> tuple[Any, Any, Any, Any, Optional[str]]:
    """``(model, optimizer, scheduler, sampler, framework)`` with the wrappers of Lightning Fabric
    and accelerate replaced by what they hold (see the module doc); other objects as given.
    ``framework`` is :data:`FABRIC` where Fabric's module or optimizer was given and none was named
    (in-process recovery then steps aside for a group restart, which resumes a Fabric loop bitwise:
    an in-process replacement in one did not, in a trial, and said nothing), else as given.

    Raises:
        BadInput: a wrapper the Guard cannot take (the message, printed first as ``trainguard:
            error: ...``, names the argument and what to pass).
    """
    fabric = compat.fabric_kind(model) is not None or compat.fabric_kind(optimizer) is not None
    try:
        unwrapped = _model(model), _optimizer(optimizer), _scheduler(scheduler), _sampler(sampler)
    except BadInput as e:
        console.line(f"trainguard: error: {e.message}")
        raise
    return (*unwrapped, framework if framework is not None or not fabric else FABRIC)
