"""trainguard: keeps long PyTorch training runs alive.

A plain loop gains resume, crash-safe checkpoints and clean preemption with a few lines::

    guard = trainguard.Guard.from_config("train.toml", model=model, optimizer=opt)
    for step in guard.steps(max_steps):
        loss = train_step()
        guard.step_end(loss=loss)

``import trainguard`` is light: it imports neither torch nor the rank-side stack. The public names
below resolve on first use (PEP 562 module ``__getattr__``), so ``trainguard.Guard`` or
``from trainguard import Guard`` imports torch then, while the command-line tools that never touch
a rank (``trainguard --help``, ``report``, ``watch``, ``slurm script``) start in a fraction of the
time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the submodule (relative to this package) that defines it
_LAZY_NAMES: dict[str, str] = {
    "Checkpoint": ".checkpoint",
    "CheckpointMismatchError": ".checkpoint",
    "CheckpointStore": ".checkpoint",
    "Config": ".config",
    "ConfigError": ".config",
    "Section": ".config",
    "config_from_argv": ".config",
    "config_from_env": ".config",
    "load_config": ".config",
    "EventLog": ".events",
    "Hook": ".events",
    "read_events": ".events",
    "ExitCode": ".exitcodes",
    "exit_bad_input": ".outcomes",
    "Guard": ".guard",
    "Outcome": ".outcomes",
    "Requeue": ".outcomes",
    "GiveUp": ".outcomes",
    "BadInput": ".outcomes",
    "Withdraw": ".outcomes",
    "ResumableSampler": ".sampler",
    "seed_everything": ".state.determinism",
    "state_hash": ".state.determinism",
}
# public submodules reached as attributes (``trainguard.dist.rank()`` after ``import trainguard``)
_LAZY_MODULES = ("dist",)

__all__ = sorted(_LAZY_NAMES) + list(_LAZY_MODULES)

if TYPE_CHECKING:  # what static tools see; at run time these resolve lazily through __getattr__
    from . import dist
    from .checkpoint import Checkpoint, CheckpointMismatchError, CheckpointStore
    from .config import Config, ConfigError, Section, config_from_argv, config_from_env, load_config
    from .events import EventLog, Hook, read_events
    from .exitcodes import ExitCode
    from .guard import Guard
    from .outcomes import BadInput, GiveUp, Outcome, Requeue, Withdraw, exit_bad_input
    from .sampler import ResumableSampler
    from .state.determinism import seed_everything, state_hash


def __getattr__(name: str) -> Any:
    """Import the submodule behind a public name on first access and cache the name here."""
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The module's attributes including the lazy public names (for ``dir()`` and completion)."""
    return sorted(set(globals()) | set(__all__))
