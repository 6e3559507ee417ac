"""Out-of-memory recovery (``guard.run_step``): micro-batch splitting, grow-back, and a gradient
all-reduce that no out-of-memory error can leave half-done. See :mod:`trainguard.oom.micro`."""

from .micro import CPU_OOM_TEXT, PHASES, MicroBatcher, batch_size, is_oom, memory_in_use, slice_batch
from .sync import GradSync

__all__ = ["CPU_OOM_TEXT", "PHASES", "GradSync", "MicroBatcher", "batch_size", "is_oom", "memory_in_use", "slice_batch"]
