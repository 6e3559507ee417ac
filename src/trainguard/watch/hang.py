"""Is the run hanging? (The "is-job-hanging" watchdog: the log stopped moving.)

A training writes an event at least every ~10 s (``progress``), so the run hangs when the newest
event of ``RUN_DIR/events.jsonl`` is older than ``max_silence`` while the run has not ended. The
run has ended when, reading the file backwards, a ``launch_exit`` comes before any ``launch``.
The watch's own events (``watch_*``) do not count as signs of life; with no training event at all
the check is skipped. When no line has a usable ``time`` (unreadable lines), the file's
modification time stands in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Optional

from ..events import EventLog
from .conditions import ALERT, OK, SKIPPED, Condition, fmt_seconds
from .config import WatchSection

BLOCK = 1 << 16


def reverse_lines(path: Path) -> Iterator[bytes]:
    """The file's lines, last first, read in blocks from the end (a long log is not read whole)."""
    with open(path, "rb") as f:
        pos = f.seek(0, os.SEEK_END)
        tail = b""
        while pos > 0:
            size = min(BLOCK, pos)
            pos -= size
            f.seek(pos)
            lines = (f.read(size) + tail).split(b"\n")
            tail = lines[0]
            yield from reversed(lines[1:])
        yield tail


def last_activity(path: Path) -> tuple[Optional[float], Optional[str], bool, bool]:
    """``(time, kind, ended, any)``: the newest training event's time and kind (``None`` if there
    is no readable one), whether the last launch has exited, and whether the file holds any line
    that is not the watch's own (an unreadable line counts)."""
    newest: Optional[float] = None
    kind: Optional[str] = None
    seen = False
    for raw in reverse_lines(path):
        if not raw.strip():
            continue
        try:
            event = json.loads(raw)
        except ValueError:
            seen = True
            continue
        if isinstance(event, dict) and str(event.get("kind", "")).startswith("watch_"):
            continue
        seen = True
        if not isinstance(event, dict):
            continue
        t = event.get("time")
        if newest is None and isinstance(t, (int, float)) and not isinstance(t, bool):
            newest, kind = float(t), str(event.get("kind"))
        if event.get("kind") in ("launch", "launch_exit"):
            return newest, kind, event["kind"] == "launch_exit", True
    return newest, kind, False, seen


def hang_condition(run_dir: Path, section: WatchSection, now: float) -> Condition:
    """The ``hang`` condition."""
    path = Path(run_dir) / EventLog.FILENAME
    if not path.exists():
        return Condition("hang", SKIPPED, f"no {EventLog.FILENAME} yet")
    newest, kind, ended, seen = last_activity(path)
    if not seen:
        return Condition("hang", SKIPPED, f"no training events in {EventLog.FILENAME} yet")
    source = f"newest event {kind!r}"
    if newest is None:
        newest, source = path.stat().st_mtime, f"{EventLog.FILENAME} modified"
    age = max(0.0, now - newest)
    values = {
        "last_event_time": newest,
        "last_event_kind": kind,
        "silence_seconds": round(age, 3),
        "max_silence": section.max_silence,
        "ended": ended,
    }
    if ended:
        return Condition("hang", OK, f"the run has ended (launch_exit); {source} {fmt_seconds(age)} ago", values)
    text = f"{source} {fmt_seconds(age)} ago"
    if age > section.max_silence:
        return Condition(
            "hang",
            ALERT,
            f"{text} (> max_silence {fmt_seconds(section.max_silence)}) and the run has not ended",
            values,
        )
    return Condition("hang", OK, text, values)
