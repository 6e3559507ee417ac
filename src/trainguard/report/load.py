"""Reading ``RUN_DIR/events.jsonl`` for a report: every well-formed event, and the line numbers of
the others (a line cut by a crash, a stray edit), which are skipped rather than fatal."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional

from ..events import EventLog, run_dir_problem


class ReportError(Exception):
    """The run cannot be reported on: a missing or unreadable run directory or event log, or a log
    without a single event. The message names the path and the problem."""


def number(value: Any) -> Optional[float]:
    """``value`` as a float if it is a number (not a bool), else ``None``."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def clean_event(raw: Any) -> Optional[dict]:
    """The event with its fields checked and normalised, or ``None`` if it is not an event.

    An event must be an object with a finite numeric ``time`` and a text ``kind``; ``details`` that
    is not an object becomes ``{}``, a ``step`` or ``attempt`` that is not an integer becomes
    ``None`` / ``0``, so the report code can rely on the types.
    """
    if not isinstance(raw, dict):
        return None
    t, kind = raw.get("time"), raw.get("kind")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not isinstance(kind, str):
        return None
    step, attempt, rank = raw.get("step"), raw.get("attempt"), raw.get("rank")
    details = raw.get("details")
    return {
        "time": float(t),
        "rank": rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        "kind": kind,
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
        "attempt": attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0,
        "pid": raw.get("pid"),
        "details": details if isinstance(details, dict) else {},
    }


def prepare(events: Iterable[Any]) -> list[dict]:
    """Clean events (see :func:`clean_event`; non-events dropped) in time order."""
    return sorted((e for e in (clean_event(raw) for raw in events) if e is not None), key=lambda e: e["time"])


def events_path(run_dir: str | os.PathLike) -> Path:
    """``RUN_DIR/events.jsonl``, after checking that the run directory exists and can be read.

    Raises:
        ReportError: the run directory is missing, not a directory or unreadable, or it has no
            ``events.jsonl``.
    """
    run_dir = Path(run_dir)
    problem = run_dir_problem(run_dir)
    if problem is not None:
        raise ReportError(problem)
    path = run_dir / EventLog.FILENAME
    if not path.exists():
        raise ReportError(f"{path} does not exist: is {run_dir} a trainguard run directory?")
    if not path.is_file():
        raise ReportError(f"{path} is not a file")
    return path


def read_event_lines(run_dir: str | os.PathLike) -> tuple[list[dict], list[int]]:
    """All well-formed events of ``RUN_DIR/events.jsonl`` in file order, and the (1-based) numbers
    of the malformed lines that were skipped. Blank lines are neither.

    Raises:
        ReportError: see :func:`events_path`; also when the file cannot be read.
    """
    path = events_path(run_dir)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror or e}") from None
    events: list[dict] = []
    bad: list[int] = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            event = clean_event(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, ValueError, RecursionError):
            event = None
        if event is None:
            bad.append(number)
        else:
            events.append(event)
    return events, bad


def describe_skipped(bad: list[int], most: int = 10) -> str:
    """``"skipped 2 malformed event lines (lines 3, 7)"`` (at most ``most`` numbers listed)."""
    shown = ", ".join(str(n) for n in bad[:most]) + (", ..." if len(bad) > most else "")
    noun = "line" if len(bad) == 1 else "lines"
    return f"skipped {len(bad)} malformed event {noun} ({noun} {shown})"


def load_events(run_dir: str | os.PathLike) -> tuple[list[dict], int]:
    """The events of a run directory and how many malformed lines were skipped.

    Malformed lines (not JSON, not an object, no numeric ``time`` or text ``kind``) are skipped
    with a :class:`UserWarning` naming their line numbers.

    Raises:
        ReportError: the run directory or its ``events.jsonl`` is missing or unreadable.
    """
    events, bad = read_event_lines(run_dir)
    if bad:
        warnings.warn(f"{Path(run_dir) / EventLog.FILENAME}: {describe_skipped(bad)}", stacklevel=2)
    return events, len(bad)
