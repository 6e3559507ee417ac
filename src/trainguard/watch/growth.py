"""Growth rate of the checkpoint directory, from the sizes recorded by earlier passes.

The rate is the least-squares slope of size over time across every recorded sample (the window of
:mod:`trainguard.watch.state`), so the save/delete sawtooth of checkpoint retention averages out
instead of the last two samples deciding. It is unknown until two samples lie at least
``MIN_SPAN`` seconds apart.
"""

from __future__ import annotations

from typing import Optional, Sequence

MIN_SPAN = 1.0


def growth_per_day(samples: Sequence[Sequence[float]]) -> Optional[float]:
    """Bytes per day (negative when shrinking), or ``None`` while fewer than two samples span ``MIN_SPAN``."""
    if len(samples) < 2:
        return None
    times = [float(s[0]) for s in samples]
    if max(times) - min(times) < MIN_SPAN:
        return None
    sizes = [float(s[1]) for s in samples]
    t0 = times[0]
    xs = [t - t0 for t in times]
    mean_x = sum(xs) / len(xs)
    mean_y = sum(sizes) / len(sizes)
    var = sum((x - mean_x) ** 2 for x in xs)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, sizes))
    return cov / var * 86400.0


def span_seconds(samples: Sequence[Sequence[float]]) -> float:
    """Seconds between the oldest and the newest sample (0 with fewer than two)."""
    if len(samples) < 2:
        return 0.0
    times = [float(s[0]) for s in samples]
    return max(times) - min(times)
