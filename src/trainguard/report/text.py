"""``render_text(report)``: the report as plain-text tables for a terminal or a ticket."""

from __future__ import annotations

from typing import Any, Optional

MAX_ROWS = 40  # incidents listed in full; a longer list shows its first and last 20
BREAKDOWN = (
    ("productive", "productive steps"),
    ("restart_overhead", "restart overhead"),
    ("redone_work", "redone work"),
    ("checkpoint_stalls", "checkpoint stalls"),
    ("other", "other"),
)


def duration(seconds: Optional[float]) -> str:
    """``0.053 s``, ``12.4 s``, ``3 min 05 s``, ``2 h 07 min``; ``-`` for none."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if abs(s) < 1:
        return f"{s:.3f} s"
    if abs(s) < 100:
        return f"{s:.1f} s"
    if abs(s) < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def clock(seconds: Optional[float]) -> str:
    """Seconds since the run began as ``m:ss.s`` (``h:mm:ss`` past an hour)."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s >= 3600:
        return f"{int(s // 3600)}:{int(s % 3600 // 60):02d}:{int(s % 60):02d}"
    return f"{int(s // 60)}:{s % 60:04.1f}"


def size(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return "-"


def table(headers: list[str], rows: list[list[Any]], indent: str = "  ") -> list[str]:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def plural(n: Any, noun: str) -> str:
    """``1 launch``, ``2 launches``, ``0 failures``."""
    return f"{n} {noun}" if str(n) == "1" else f"{n} {noun}es" if noun.endswith(("ch", "s")) else f"{n} {noun}s"


def _pct(part: Optional[float], whole: Optional[float]) -> str:
    return f"{100.0 * part / whole:5.1f} %" if part is not None and whole else "    -"


def _steps(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _incidents(report: dict) -> list[str]:
    incidents = report["incidents"]
    injected = sum(i["injected"] for i in incidents)
    lines = [f"Incidents: {len(incidents)}" + (f" ({injected} injected)" if injected else "")]
    if not incidents:
        return lines
    rec = report["failure_recovery"]
    if rec["in_process"]["count"]:
        parts = [
            f"{how.replace('_', ' ')} {r['count']} (median {duration(r['median_seconds'])} to recover, "
            f"{_steps(r['steps_lost'])} steps lost)"
            for how, r in rec.items()
            if r["count"]
        ]
        lines.append("  failures recovered: " + "; ".join(parts))
    kinds = report["incident_counts"]
    if len(kinds) > 1 or len(incidents) > MAX_ROWS:
        lines.append("  by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    shown = list(enumerate(incidents, 1))
    if len(shown) > MAX_ROWS:
        shown = shown[: MAX_ROWS // 2] + [None] + shown[-MAX_ROWS // 2 :]
    rows = []
    for item in shown:
        if item is None:
            rows.append(["..."] * 11)
            continue
        n, i = item
        step = "-" if i["step"] is None else ("~" if i["step_estimated"] else "") + _steps(i["step"])
        rows.append(
            [
                n,
                clock(i["detected_at"]),
                i["kind"],
                "yes" if i["injected"] else "no",
                ",".join(map(str, i["ranks"])) or "-",
                step,
                _steps(i["resumed_from_step"]),
                _steps(i["steps_lost"]),
                duration(i["detection_latency"]),
                duration(i["time_to_recover"]) if i["recovered"] else "not recovered",
                duration(i["redone_seconds"]),
            ]
        )
    lines += table(
        ["#", "seen at", "kind", "injected", "ranks", "step", "resumed", "lost", "detect", "recover", "redone"], rows
    )
    if len(incidents) > MAX_ROWS:
        lines.append(f"  ({len(incidents) - MAX_ROWS} more in --json)")
    lines += [f"  {item[0]}: {item[1]['reason']}" for item in shown if item is not None and item[1]["reason"]]
    return lines


def _checkpoints(report: dict) -> list[str]:
    c = report["checkpoints"]
    s = c["save_seconds"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(c["by_reason"].items()))
    lines = [
        f"Checkpoints: {c['count']} committed"
        + (f" ({reasons})" if reasons else "")
        + f", {c['failures']} failed, {c['invalid']} invalid"
    ]
    if c["count"]:
        lines.append(
            f"  size (median) {size(c['bytes_median'])}; save median {duration(s['median'])}, "
            f"p90 {duration(s['p90'])}, max {duration(s['max'])}, total {duration(s['total'])}"
        )
    return lines


def _interval(report: dict) -> list[str]:
    iv = report["checkpoint_interval"]
    lines = ["Checkpoint interval (Young 1974, Daly 2006)"]
    used = iv["used_steps"]
    used_text = "-" if used is None else f"{used:g} steps"
    if used is not None and iv["used_seconds"]:
        used_text += f" ({duration(iv['used_seconds'])} of compute)"
    if iv["mtbf_seconds"] is None:
        lines.append(f"  {iv['note']}")
        lines.append(f"  used: {used_text}")
        return lines
    injected = f", {iv['failures_injected']} injected" if iv.get("failures_injected") else ""
    lines.append(
        f"  C = median save {duration(iv['save_seconds'])}, M = wall / failures = "
        f"{duration(iv['mtbf_seconds'])} ({plural(iv['failures'], 'failure')}{injected})"
    )
    lines += table(
        ["", "seconds", "steps"],
        [
            ["Young  sqrt(2CM)", duration(iv["young_seconds"]), _steps(iv["young_steps"])],
            ["Daly   higher order", duration(iv["daly_seconds"]), _steps(iv["daly_steps"])],
            ["used by the run", duration(iv["used_seconds"]), _steps(used)],
        ],
    )
    if used and iv["daly_steps"]:
        ratio = used / iv["daly_steps"]
        verdict = (
            "close to the optimum"
            if 0.5 <= ratio <= 2
            else f"{1 / ratio:.1f}x more often than the optimum"
            if ratio < 0.5
            else f"{ratio:.1f}x less often than the optimum"
        )
        lines.append(f"  the run checkpoints {verdict}")
    if iv["note"]:
        lines.append(f"  note: {iv['note']}")
    return lines


def render_text(report: dict) -> str:
    """The report as text: summary, time breakdown, incidents, checkpoints, checkpoint interval."""
    wall = report["wall_seconds"]
    code = "" if report["exit_code"] is None else f", exit code {report['exit_code']}"
    lines = [
        f"Run: {report['status']}{code}",
        f"  wall time {duration(wall)}, {plural(report['launches'], 'launch')}, "
        f"{plural(report['attempts'], 'worker-group start')}, final step {_steps(report['final_step'])}, "
        f"{plural(_steps(report['steps_lost']), 'step')} lost"
        + (f", {duration(report['seconds_per_step'])} per step (median)" if report["seconds_per_step"] else ""),
    ]
    sizes = report.get("world_sizes") or []
    if len(sizes) > 1:  # the world size changed: when, and over which steps
        lines.append(
            "  world size: "
            + ", then ".join(
                f"{plural(w['world_size'], 'rank')} from {duration(w['from'])} (steps {w['first_step']}–{_steps(w['last_step'])})"
                for w in sizes
            )
        )
    elif sizes:
        lines.append(f"  world size: {plural(sizes[0]['world_size'], 'rank')}")
    lines.append("")
    goodput = report["goodput"]
    lines.append(
        "Goodput: " + ("-" if goodput is None else f"{100 * goodput:.1f} %") + " (productive step time / wall time)"
    )
    parts = report["time_breakdown"]
    lines += table(
        ["", "time", "share"], [[label, duration(parts[key]), _pct(parts[key], wall)] for key, label in BREAKDOWN]
    )
    lines.append("")
    lines += _incidents(report)
    lines.append("")
    lines += _checkpoints(report)
    lines.append("")
    lines += _interval(report)
    if report["notices"]:
        lines += ["", "Notices: " + ", ".join(f"{k} {v}" for k, v in sorted(report["notices"].items()))]
    return "\n".join(lines) + "\n"
