"""trainguard: keeps long PyTorch training runs alive.

A plain loop gains resume, crash-safe checkpoints and clean preemption with a few lines::

    guard = trainguard.Guard.from_config("train.toml", model=model, optimizer=opt)
    for step in guard.steps(max_steps):
        loss = train_step()
        guard.step_end(loss=loss)
"""

from .checkpoint import Checkpoint, CheckpointMismatchError, CheckpointStore
from .config import Config, ConfigError, Section, config_from_argv, load_config
from .events import EventLog, Hook, read_events
from .exitcodes import ExitCode
from .guard import Guard, exit_bad_input
from .sampler import ResumableSampler
from . import dist
from .state import seed_everything, state_hash

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "CheckpointMismatchError", "CheckpointStore", "Config", "ConfigError", "EventLog",
    "ExitCode", "Guard", "exit_bad_input", "Hook", "ResumableSampler", "Section", "config_from_argv", "load_config",
    "dist", "read_events", "seed_everything", "state_hash",
]
