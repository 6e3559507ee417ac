"""``build_report(events)``: the whole report as one JSON-serialisable dict.

Sections: the run (status, launches, worker-group starts, wall time, final step), ``goodput`` and
its ``time_breakdown`` (:mod:`.goodput`), ``incidents`` (:mod:`.incidents`), ``checkpoints``
(:mod:`.checkpoints`), ``checkpoint_interval`` (Young/Daly, :mod:`.interval`), ``launch_history``
and ``notices`` (counts of events worth a look that are no incident). Times inside the report are
seconds since the run's first event unless a key says ``_time`` (Unix time).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from .checkpoints import summarize
from .goodput import breakdown, kept_step
from .history import RunHistory, reconstruct
from .incidents import FAILURE_KINDS, Incident
from .interval import recommend
from .load import ReportError, prepare

STATUS = {0: "finished", 2: "bad input", 75: "stopped, resumable (requeue)", 76: "gave up"}


def _r(value: Optional[float], digits: int = 3) -> Optional[float]:
    return None if value is None else round(float(value), digits)


def _step(value: Optional[float]) -> Optional[Any]:
    if value is None:
        return None
    return int(value) if float(value).is_integer() else round(value, 1)


def _incident(inc: Incident, t0: float, redone: float, checkpoints: list[dict]) -> dict:
    recovered = inc.recovered_at is not None
    resumed = inc.resumed_step if recovered else None
    if inc.terminal or inc.step is None:
        lost = None
    else:
        base = resumed if recovered else kept_step(inc, checkpoints)
        lost = None if base is None else max(0.0, inc.step - base)
    return {
        "kind": inc.kind,
        "injected": inc.injected,
        "launch": inc.launch,
        "attempt": inc.attempt,
        "ranks": inc.ranks,
        "step": _step(inc.step),
        "step_estimated": inc.step_estimated,
        "failed_at": _r(inc.failed_at - t0),
        "detected_at": _r(inc.detected_at - t0),
        "detected_time": _r(inc.detected_at, 6),
        "detection_latency": _r(inc.latency),
        "recovered": recovered,
        "time_to_recover": _r(inc.recovered_at - inc.detected_at) if recovered else None,
        "resumed_from_step": _step(resumed),
        "steps_lost": _step(lost),
        "redone_seconds": _r(redone),
        "planned": inc.planned,
        "in_process": inc.in_process,
        "reason": inc.reason,
    }


def _failure_recovery(incidents: list[dict]) -> dict:
    """Lost ranks and hangs by how training went on: in-process (the survivors stayed) or by a
    group restart; for each, the count, the median time to recover (seconds) and the steps lost."""
    out = {}
    for how, in_process in (("in_process", True), ("group_restart", False)):
        done = [i for i in incidents if i["kind"] in FAILURE_KINDS and i["in_process"] == in_process and i["recovered"]]
        times = sorted(i["time_to_recover"] for i in done if i["time_to_recover"] is not None)
        out[how] = {
            "count": len(done),
            "median_seconds": _r(times[len(times) // 2]) if times else None,
            "steps_lost": _step(sum(i["steps_lost"] or 0 for i in done)),
        }
    return out


def _status(history: RunHistory) -> tuple[str, Optional[int]]:
    """A word for how the run stands, and the newest launch's exit code."""
    if history.launches and (history.launch_open or len(history.launch_exits) < history.launches):
        return "running (or its launcher was lost)", None
    if history.launch_exits:
        code = history.launch_exits[-1]["details"].get("code")
        return STATUS.get(code, f"failed (exit code {code})"), code
    how = history.segments[-1].how if history.segments else "no training loop started"
    return {"stopped": "stopped, resumable (requeue)"}.get(how, how), None  # a run without the launcher


def build_report(events: Iterable[dict]) -> dict:
    """The report of a run from its events (as :func:`~trainguard.report.load_events` returns them;
    raw dicts are checked the same way and non-events dropped).

    Raises:
        ReportError: there is not a single event.
    """
    events = prepare(events)
    if not events:
        raise ReportError("the event log has no events")
    t0, t1 = events[0]["time"], events[-1]["time"]
    wall = t1 - t0
    history = reconstruct(events)
    parts, redone_each = breakdown(history.segments, history.incidents, history.checkpoints, t0, t1)
    incidents = [_incident(i, t0, r, history.checkpoints) for i, r in zip(history.incidents, redone_each)]
    counts: dict[str, int] = {}
    for inc in incidents:
        counts[inc["kind"]] = counts.get(inc["kind"], 0) + 1
    ckpt = summarize(
        history.checkpoints, history.notices.get("checkpoint_failed", 0), history.notices.get("checkpoint_invalid", 0)
    )
    per_step = history.seconds_per_step
    failures = [i for i in history.incidents if i.kind in FAILURE_KINDS]
    interval = recommend(ckpt["blocked_seconds"]["median"], wall, len(failures), per_step, ckpt["interval_steps"])
    interval["failures_injected"] = sum(i.injected for i in failures)
    status, code = _status(history)
    final = max((s.last_step() for s in history.segments), default=None)
    return {
        "start_time": _r(t0, 6),
        "end_time": _r(t1, 6),
        "status": status,
        "exit_code": code,
        "wall_seconds": _r(wall, 6),
        "launches": history.launches,
        "attempts": history.attempts or len({(s.launch, s.attempt) for s in history.segments}),
        "training_loops": len(history.segments),
        "final_step": _step(history.segments[-1].last_step()) if history.segments else None,
        "highest_step": _step(final),
        "seconds_per_step": _r(per_step, 6),
        "goodput": _r(parts["productive"] / wall, 4) if wall > 0 else None,
        "time_breakdown": {k: _r(v, 6) for k, v in parts.items()},
        "steps_lost": _step(sum(i["steps_lost"] or 0 for i in incidents)),
        "incident_counts": counts,
        "failure_recovery": _failure_recovery(incidents),
        "incidents": incidents,
        "checkpoints": {k: (_r(v) if isinstance(v, float) else v) for k, v in ckpt.items() if k != "save_seconds"}
        | {"save_seconds": {k: _r(v, 4) for k, v in ckpt["save_seconds"].items()}},
        "checkpoint_interval": {k: (_r(v, 6) if isinstance(v, float) else v) for k, v in interval.items()},
        "launch_history": [
            {
                "launch": e["launch"],
                "ended_at": _r(e["time"] - t0),
                "seconds": e["details"].get("seconds"),
                "code": e["details"].get("code"),
                "reason": e["details"].get("reason"),
            }
            for e in history.launch_exits
        ],
        "notices": history.notices,
        "world_sizes": _world_sizes(history.segments, t0),
    }


def _world_sizes(segments: list, t0: float) -> list[dict]:
    """The world size over time: one entry per stretch of training with the same number of ranks,
    across loops and shrinks in place (``from``: seconds after the first event, ``steps``: first
    and last step)."""
    out: list[dict] = []
    for seg in segments:
        for start, first, world, last in seg.sizes():
            if world is None:
                continue
            if out and out[-1]["world_size"] == world:
                out[-1]["last_step"] = _step(last)
                continue
            out.append({"world_size": world, "from": _r(start - t0), "first_step": first, "last_step": _step(last)})
    return out
