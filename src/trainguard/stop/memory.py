"""Memory watchdog (``[memory]``): leave voluntarily, with a checkpoint, before memory runs out.

Every ``check_interval`` steps (at the Guard's next stop check) each rank measures the host's used
memory (percent), its own resident set size, and — with ``gpu_free_min`` on a machine with a GPU —
its GPU's free memory after ``gc.collect()`` and ``torch.cuda.empty_cache()`` (so blocks cached by
PyTorch's allocator count as free). A rank over a limit writes a ``memory_watchdog`` event and
raises the ``memory`` stop flag; the flag travels in the stop check's all-reduce, so every rank
saves at the same step and the run exits with the requeue code (75). The next launch starts
with the memory reclaimed.
"""

from __future__ import annotations

import gc
from typing import Any

import psutil
import torch

from ..events import EventLog
from ..sections import MemorySection


class MemoryWatchdog:
    """This rank's memory limits.

    Args:
        cfg: the ``[memory]`` section.
        events: where ``memory_watchdog`` events go.
    """

    def __init__(self, cfg: MemorySection, events: EventLog):
        self.cfg, self.events = cfg, events
        self.enabled = any(v is not None for v in (cfg.host_percent, cfg.rss_limit, cfg.gpu_free_min))
        self.last_step = 0  # step of the last measurement

    def measure(self) -> dict[str, Any]:
        """Current readings: ``host_percent`` (0–100), ``rss_bytes``, and ``gpu_free_bytes`` /
        ``gpu_total_bytes`` (only with ``gpu_free_min`` set and a GPU; after emptying the cache)."""
        reading: dict[str, Any] = {
            "host_percent": psutil.virtual_memory().percent,
            "rss_bytes": psutil.Process().memory_info().rss,
        }
        if self.cfg.gpu_free_min is not None and torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            reading.update(gpu_free_bytes=free, gpu_total_bytes=total)
        return reading

    def exceeded(self, reading: dict[str, Any]) -> list[str]:
        """The limits ``reading`` breaks, each as text naming the key, the value and the limit."""
        c, out = self.cfg, []
        if c.host_percent is not None and reading["host_percent"] > c.host_percent:
            out.append(f"host memory {reading['host_percent']:.1f}% used > memory.host_percent={c.host_percent}")
        if c.rss_limit is not None and reading["rss_bytes"] > c.rss_limit:
            out.append(f"resident set {reading['rss_bytes']} bytes > memory.rss_limit={c.rss_limit}")
        if c.gpu_free_min is not None and "gpu_free_bytes" in reading and reading["gpu_free_bytes"] < c.gpu_free_min:
            out.append(f"GPU free {reading['gpu_free_bytes']} bytes < memory.gpu_free_min={c.gpu_free_min}")
        return out

    def over(self, step: int) -> bool:
        """Measure if ``check_interval`` steps have passed since the last measurement; ``True`` (and
        a ``memory_watchdog`` event) when a limit is exceeded."""
        if not self.enabled or step - self.last_step < self.cfg.check_interval:
            return False
        self.last_step = step
        reading = self.measure()
        broken = self.exceeded(reading)
        if broken:
            self.events.emit("memory_watchdog", step, exceeded=broken, **reading)
        return bool(broken)
