"""Training segments: one per ``start`` event (a training loop of one worker group), with the
(time, step) positions the events pin down, and what can be read off them: when a step was reached,
the step at a moment, the step time.

Known positions of a segment: its ``start`` (``first_step``), every ``progress`` event, every
committed checkpoint twice (its save began when the step completed, ``seconds`` before the
commit, and ended at the commit), injected faults with a step, a ``stop_requested``, the ``end``
and, after an instability rollback, the rollback (the step drops back to the checkpoint's).
Between two positions steps are taken to advance at a constant rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass
class Segment:
    """One training loop: from its ``start`` event until it finished, stopped or failed.

    ``end`` is the moment it stopped making progress (``None`` while it runs: the log's end then
    counts), ``how`` says why: ``finished``, ``stopped``, ``failed``, ``lost`` (no event says) or
    ``running``.
    """

    launch: int
    attempt: int
    start: float
    first_step: int
    points: list[tuple[float, float]] = field(default_factory=list)
    end: Optional[float] = None
    how: str = "running"
    world_size: Optional[int] = None  # ranks of the loop (its ``start`` event)
    # the loop went on with another number of ranks (a shrink in place): (time, step, world size)
    resized: list[tuple[float, int, int]] = field(default_factory=list)

    def sizes(self) -> list[tuple[float, int, Optional[int], float]]:
        """The loop's stretches of one world size: ``(start time, first step, world size, last step)``."""
        marks = [(self.start, self.first_step, self.world_size), *self.resized]
        ends = [float(step) for _, step, _ in self.resized] + [self.last_step()]
        return [(t, step, world, end) for (t, step, world), end in zip(marks, ends)]

    def __post_init__(self) -> None:
        if not self.points:
            self.points.append((self.start, float(self.first_step)))

    def add(self, t: float, step: Optional[float]) -> None:
        """Record that the loop was at ``step`` at time ``t`` (ignored once the segment ended)."""
        if step is None or (self.end is not None and t > self.end):
            return
        self.points.append((t, float(step)))
        if len(self.points) > 1 and self.points[-2][0] > t:  # events of several processes: keep time order
            self.points.sort(key=lambda p: p[0])

    def close(self, t: float, how: str) -> None:
        """End the segment at ``t`` (the first reason wins)."""
        if self.end is None:
            self.end = max(t, self.start)
            self.how = how

    def last_step(self, before: Optional[float] = None) -> float:
        """The newest known step at or before ``before`` (default: the newest)."""
        pts = [p for p in self.points if before is None or p[0] <= before]
        return pts[-1][1] if pts else float(self.first_step)

    def reached(self, step: float, before: float) -> tuple[Optional[float], bool]:
        """When the loop (last) reached ``step`` before time ``before``.

        Returns ``(time, started_beyond)``: ``time`` is ``None`` when the step was not reached in
        this segment; ``started_beyond`` is True when the segment began past ``step``, so all of it
        lies beyond that step (the caller looks at the segment before).
        """
        pts = [p for p in self.points if p[0] <= before]
        if not pts or pts[0][1] > step:
            return None, True
        when: Optional[float] = pts[0][0] if pts[0][1] == step else None
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if s1 < s0:  # a rollback: the steps above s1 are no longer the loop's
                if s1 < step:
                    when = None
                elif s1 == step:
                    when = t1
            elif s0 < step <= s1:
                when = t0 + (t1 - t0) * (step - s0) / (s1 - s0)
        return when, False


def weighted_median(samples: Iterable[tuple[float, float]]) -> Optional[float]:
    """Median of ``(value, weight)`` samples (``None`` if there are none)."""
    items = sorted((v, w) for v, w in samples if w > 0)
    total = sum(w for _, w in items)
    if total <= 0:
        return None
    acc = 0.0
    for value, weight in items:
        acc += weight
        if acc >= total / 2:
            return value
    return items[-1][0]


def step_seconds(segments: list[Segment], progress: Iterable[float] = ()) -> Optional[float]:
    """Median seconds per step: from the step times ``progress`` events measured, and from every
    pair of neighbouring positions of a segment between which the step advanced and no checkpoint
    was being saved (weighted by the steps in between)."""
    samples = [(s, 1.0) for s in progress if s > 0]
    for seg in segments:
        for (t0, s0), (t1, s1) in zip(seg.points, seg.points[1:]):
            if s1 > s0 and t1 > t0:
                samples.append(((t1 - t0) / (s1 - s0), s1 - s0))
    return weighted_median(samples)


def extrapolate(seg: Segment, t: float, seconds_per_step: Optional[float]) -> tuple[float, bool]:
    """The step the loop had completed at time ``t``: the newest known position, plus the steps
    ``seconds_per_step`` allows since then (never past the segment's end). Returns ``(step, estimated)``."""
    if seg.end is not None:
        t = min(t, seg.end)
    t_last, s_last = max((p for p in seg.points if p[0] <= t), key=lambda p: p[0], default=(seg.start, seg.first_step))
    if not seconds_per_step or t <= t_last:
        return s_last, False
    return float(s_last + int((t - t_last) / seconds_per_step)), True
