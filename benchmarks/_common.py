"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

from trainguard.events import read_events


def trainguard_cmd() -> list[str]:
    """The ``trainguard`` command of this interpreter's environment."""
    exe = Path(sys.executable).parent / "trainguard"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "trainguard.cli"]


def run_events(run_dir: Path) -> list[dict]:
    """All events of a run directory (malformed lines skipped)."""
    return list(read_events(run_dir))


def exited(pid: int) -> bool:
    """True once ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
