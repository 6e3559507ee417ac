"""Goodput: the share of a run's wall time spent computing steps that were kept.

Goodput (the "effective training time ratio") = productive step time / wall time, wall time being
the first event to the last. Every moment of the wall time gets exactly one label, by the first
rule that applies, so the parts add up to the wall time:

1. ``checkpoint_stalls``: the time training waited for a save: ``[started, started +
   blocked_seconds]`` of each ``checkpoint_committed`` (an async save blocks only for its snapshot;
   older logs without ``started``: ``[commit − seconds, commit]``, a synchronous save).
2. ``restart_overhead``: from the moment an incident stopped progress (an injected fault's time;
   else for a hang the detection minus the seconds the rank was silent, for a ping timeout the
   detection minus the ping timeout, for a crash or stop the event that reports it) until the next
   ``start`` event; and every gap between two training loops (group restarts, the relaunch gap
   between launches, setup and checkpoint loading of the new workers). The time to *detect* a
   failure is therefore part of it. After a failure with no later ``start`` it runs to the end of
   the log; for in-process recoveries it is detection → ``rollback`` / ``micro_batch_split``.
3. ``redone_work``: steps computed and then thrown away. For a failure at step F resumed from the
   checkpoint of step R (the next ``start``'s ``first_step``; for a rollback its ``to_step``; for a
   failure never resumed, the newest checkpoint ≤ F), the time from when the loop passed step R to
   the failure. When a step was passed is interpolated between the known (time, step) positions
   of the loop (:mod:`.timeline`: start, progress, checkpoint save begin/end, faults, end), i.e.
   from the step rate around the failure; a loop that began beyond R counts whole, and the loop
   before it is searched for R.
4. ``productive``: the rest of every training loop (``start`` to the moment it stopped).
5. ``other``: the rest: setup before the first step, evaluation and exit after the last.
"""

from __future__ import annotations

from typing import Iterable, Optional

from .incidents import FAILURE_KINDS, IN_PROCESS_ROLLBACKS, Incident
from .timeline import Segment

Intervals = list[tuple[float, float]]


def stall(c: dict) -> tuple[float, float]:
    """The interval training waited for the save of a ``checkpoint_committed`` event."""
    d = c["details"]
    if d.get("started") is not None and d.get("blocked_seconds") is not None:
        return float(d["started"]), float(d["started"]) + float(d["blocked_seconds"])
    return c["time"] - float(d.get("seconds") or 0.0), c["time"]


def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint cover of the given (non-empty) intervals."""
    out: Intervals = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """``a`` minus ``b`` (both sorted and disjoint)."""
    out: Intervals = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k, cur = j, lo
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def total(intervals: Intervals) -> float:
    return sum(b - a for a, b in intervals)


def clip(intervals: Iterable[tuple[float, float]], t0: float, t1: float) -> Intervals:
    return union((max(a, t0), min(b, t1)) for a, b in intervals)


def kept_step(inc: Incident, checkpoints: list[dict]) -> Optional[float]:
    """The step training went on (or would go on) from after ``inc``."""
    if inc.resumed_step is not None:
        return inc.resumed_step
    older = [
        c["step"]
        for c in checkpoints
        if c["step"] is not None and c["time"] <= inc.failed_at and (inc.step is None or c["step"] <= inc.step)
    ]
    return float(max(older, default=0))


def redone_windows(inc: Incident, segments: list[Segment], checkpoints: list[dict]) -> Intervals:
    """The time spent on the steps ``inc`` threw away (see the module docstring, rule 3)."""
    if inc.kind not in FAILURE_KINDS + IN_PROCESS_ROLLBACKS or inc.segment is None or inc.step is None:
        return []
    keep = kept_step(inc, checkpoints)
    if keep is None or inc.step <= keep:
        return []
    index = next((i for i, s in enumerate(segments) if s is inc.segment), None)
    if index is None:
        return []
    out: Intervals = []
    for seg in reversed(segments[: index + 1]):
        end = inc.failed_at if seg is inc.segment else (seg.end if seg.end is not None else inc.failed_at)
        when, beyond = seg.reached(keep, end)
        if beyond:
            out.append((seg.start, end))
            continue
        if when is not None:
            out.append((when, end))
        break
    return out


def breakdown(
    segments: list[Segment], incidents: list[Incident], checkpoints: list[dict], t0: float, t1: float
) -> tuple[dict[str, float], list[float]]:
    """Seconds per label (``productive``, ``restart_overhead``, ``redone_work``,
    ``checkpoint_stalls``, ``other``) over ``[t0, t1]``, and each incident's redone seconds."""
    stalls = clip((stall(c) for c in checkpoints), t0, t1)
    gaps = [(a.end if a.end is not None else b.start, b.start) for a, b in zip(segments, segments[1:])]
    waits = [(i.failed_at, i.recovered_at if i.recovered_at is not None else t1) for i in incidents]
    restart = clip(gaps + waits, t0, t1)
    per_incident = [clip(redone_windows(i, segments, checkpoints), t0, t1) for i in incidents]
    redone = union(iv for windows in per_incident for iv in windows)
    loops = clip(((s.start, s.end if s.end is not None else t1) for s in segments), t0, t1)

    above = stalls
    restart_only = subtract(restart, above)
    above = union(above + restart)
    redone_only = subtract(redone, above)
    above = union(above + redone)
    productive = subtract(loops, above)
    parts = {
        "productive": total(productive),
        "restart_overhead": total(restart_only),
        "redone_work": total(redone_only),
        "checkpoint_stalls": total(stalls),
    }
    parts["other"] = max(0.0, (t1 - t0) - sum(parts.values()))
    above_redone = union(stalls + restart)
    return parts, [total(subtract(w, above_redone)) for w in per_incident]
