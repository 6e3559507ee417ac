"""``trainguard run``: the elastic launcher with restart, signal forwarding and exit codes."""

from .lock import RunDirLock, RunDirLocked
from .run import LaunchOptions, launch

__all__ = ["LaunchOptions", "RunDirLock", "RunDirLocked", "launch"]
