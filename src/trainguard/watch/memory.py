"""Node memory: psutil's ``virtual_memory().percent`` (used memory, as ``[memory] host_percent`` reads it)."""

from __future__ import annotations

import psutil

from .conditions import ALERT, OK, Condition, fmt_bytes
from .config import WatchSection


def memory_condition(section: WatchSection) -> Condition:
    """The ``memory`` condition."""
    vm = psutil.virtual_memory()
    values = {
        "percent": vm.percent,
        "total": vm.total,
        "available": vm.available,
        "max_memory_percent": section.max_memory_percent,
    }
    text = f"{vm.percent:.1f} % of {fmt_bytes(vm.total)} used, {fmt_bytes(vm.available)} available"
    if section.max_memory_percent is not None and vm.percent > section.max_memory_percent:
        return Condition("memory", ALERT, f"{text}; > max_memory_percent {section.max_memory_percent:g} %", values)
    return Condition("memory", OK, text, values)
