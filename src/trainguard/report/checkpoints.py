"""Checkpoint statistics of a run: how many, how big, how long the saves took, failures, and the
interval (in steps) the run saved at."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from .load import number


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0–100) with linear interpolation between order statistics
    (numpy's default method); ``None`` for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def used_interval(committed: list[dict]) -> Optional[float]:
    """Median steps between consecutive ``interval`` checkpoints of the same worker group (a
    resume or rollback in between does not count as an interval)."""
    diffs: list[float] = []
    prev: dict = {}
    for c in committed:
        if c["details"].get("reason") != "interval" or c["step"] is None:
            continue
        key = (c.get("launch"), c["attempt"])
        if key in prev and c["step"] > prev[key]:
            diffs.append(c["step"] - prev[key])
        prev[key] = c["step"]
    return statistics.median(diffs) if diffs else None


def summarize(committed: list[dict], failed: int, invalid: int) -> dict:
    """The report's ``checkpoints`` section from the ``checkpoint_committed`` events."""
    seconds = [s for s in (number(c["details"].get("seconds")) for c in committed) if s is not None]
    blocked = [
        s
        for s in (number(c["details"].get("blocked_seconds", c["details"].get("seconds"))) for c in committed)
        if s is not None
    ]
    sizes = [b for b in (number(c["details"].get("bytes")) for c in committed) if b is not None]
    reasons: dict[str, int] = {}
    for c in committed:
        reason = str(c["details"].get("reason", "unknown"))
        reasons[reason] = reasons.get(reason, 0) + 1
    return {
        "count": len(committed),
        "by_reason": reasons,
        "bytes_median": statistics.median(sizes) if sizes else None,
        "save_seconds": {
            "median": statistics.median(seconds) if seconds else None,
            "p90": percentile(seconds, 90),
            "max": max(seconds) if seconds else None,
            "total": sum(seconds),
        },
        "blocked_seconds": {  # training waited this long (= save_seconds for synchronous saves)
            "median": statistics.median(blocked) if blocked else None,
            "total": sum(blocked),
        },
        "failures": failed,
        "invalid": invalid,
        "interval_steps": used_interval(committed),
        "last_step": max((c["step"] for c in committed if c["step"] is not None), default=None),
    }
