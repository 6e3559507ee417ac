"""Crash-safe checkpoint store: atomic commit, manifests with checksums, retention, DCP I/O."""

from .io import CheckpointMismatchError, check_compatible, load_state, save_state
from .store import Checkpoint, CheckpointStore

__all__ = ["Checkpoint", "CheckpointMismatchError", "CheckpointStore", "check_compatible", "load_state", "save_state"]
