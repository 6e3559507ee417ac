"""``render_png(events, report, path)``: the run's timeline as a picture.

Steps over wall time (minutes since the first event): one line per training loop through its known
positions (start, progress, checkpoint saves, faults, end), a marker at every committed checkpoint,
a cross at every injected fault, and a coloured band per incident from its detection to the
recovery (to the end of the run if it never recovered), hatched from the failure to its detection. Drawn with matplotlib's Agg canvas on a
``Figure`` of its own (no pyplot, no global backend switch), so it works without a display.

matplotlib is the optional extra ``trainguard[report]``, imported only when a picture is drawn.
"""

from __future__ import annotations

import os
from typing import Iterable

from .history import reconstruct
from .load import ReportError, prepare

MISSING = (
    "the picture needs matplotlib, which is not installed ({error}); install it with: pip install 'trainguard[report]'"
)

COLOURS = {
    "rank_killed": "tab:red",
    "rank_crashed": "tab:red",
    "node_lost": "darkred",
    "hang": "tab:orange",
    "ping_timeout": "tab:brown",
    "preemption_signal": "tab:blue",
    "membership_change": "tab:green",
    "time_limit": "tab:cyan",
    "kill_switch": "tab:gray",
    "memory": "tab:purple",
    "straggler": "tab:olive",
    "instability_rollback": "tab:pink",
    "sdc_rerun": "magenta",
    "sdc_exclude": "darkmagenta",
    "sdc_transient": "orchid",
    "rank_withdrawn": "purple",
    "oom_split": "gold",
    "give_up": "black",
    "bad_input": "black",
    "launch_lost": "darkred",
    "launch_failed": "black",
}


def render_png(events: Iterable[dict], report: dict, path: str | os.PathLike) -> None:
    """Write the timeline of ``events`` (titled with ``report``'s goodput) to ``path`` as a PNG.

    Raises:
        OSError: ``path`` cannot be written.
        ReportError: matplotlib is not installed (the ``trainguard[report]`` extra).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ReportError(MISSING.format(error=e)) from None

    events = prepare(events)
    t0 = events[0]["time"] if events else 0.0
    history = reconstruct(events)

    def minutes(t: float) -> float:
        return (t - t0) / 60.0

    fig = Figure(figsize=(11, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    sizes = {w for seg in history.segments for _, _, w, _ in seg.sizes()}  # world sizes seen
    before = None  # the world size of the stretch before: a change is labelled
    for n, seg in enumerate(history.segments):
        pts = [p for p in seg.points if seg.end is None or p[0] <= seg.end + 1e-9]
        ax.plot(
            [minutes(t) for t, _ in pts],
            [s for _, s in pts],
            color="tab:green",
            linewidth=1.6,
            label="training (one line per worker group)" if n == 0 else None,
        )
        for start, first, world, _ in seg.sizes():
            if world is not None and world != before and len(sizes) > 1:
                ax.annotate(f"{world} ranks", (minutes(start), first), fontsize=8, color="tab:green")
            before = world
    ckpts = history.checkpoints
    if ckpts:
        ax.scatter(
            [minutes(c["time"]) for c in ckpts],
            [c["step"] or 0 for c in ckpts],
            marker="o",
            s=14,
            facecolors="none",
            edgecolors="tab:green",
            zorder=3,
            label="checkpoint committed",
        )
    faults = [
        (minutes(e["time"]), e["step"]) for e in events if e["kind"] == "fault_injected" and e["step"] is not None
    ]
    if faults:
        ax.scatter(
            [f[0] for f in faults],
            [f[1] for f in faults],
            marker="x",
            s=40,
            color="black",
            zorder=4,
            label="fault injected",
        )
    end = minutes(events[-1]["time"]) if events else 0.0
    seen: set[str] = set()
    for inc in report.get("incidents", []):
        start = inc["detected_at"] / 60.0
        stop = inc["detected_at"] + inc["time_to_recover"] if inc["recovered"] else None
        stop = end if stop is None else stop / 60.0
        colour = COLOURS.get(inc["kind"], "tab:gray")
        label = None if inc["kind"] in seen else inc["kind"].replace("_", " ")
        seen.add(inc["kind"])
        ax.axvspan(start, max(stop, start + end / 500.0), color=colour, alpha=0.25, label=label, linewidth=0)
        if inc["failed_at"] is not None and inc["failed_at"] < inc["detected_at"]:  # until it was noticed
            ax.axvspan(
                inc["failed_at"] / 60.0, start, facecolor="none", edgecolor=colour, hatch="///", alpha=0.6, linewidth=0
            )
    goodput = report.get("goodput")
    title = "goodput " + ("-" if goodput is None else f"{100 * goodput:.1f} %")
    n = len(report.get("incidents", []))
    title += f"  ·  {n} incident{'' if n == 1 else 's'}  ·  {report.get('status', '')}"
    ax.set_title(title)
    ax.set_xlabel("minutes since the run began")
    ax.set_ylabel("step")
    ax.set_xlim(0, max(end, 1e-3))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", framealpha=0.85)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
