"""``trainguard report``: an operator's account of a run, read only from ``RUN_DIR/events.jsonl``.

* :func:`load_events` — the events, tolerating malformed lines (skipped, counted, warned about);
* :func:`build_report` — goodput and where the rest of the wall time went (:mod:`.goodput`), one
  incident per failure or stop with detection latency, time to recover and steps lost
  (:mod:`.incidents`), checkpoint costs (:mod:`.checkpoints`) and the optimal checkpoint interval
  after Young (1974) and Daly (2006) (:mod:`.interval`);
* :func:`render_text` / :func:`render_png` — a table for the terminal, a timeline picture;
* :func:`main` — the command: text or JSON on stdout, the picture, exit code 0 or 2.
"""

from .build import build_report
from .command import main
from .interval import daly_interval, young_interval
from .load import ReportError, load_events
from .plot import render_png
from .text import render_text

__all__ = [
    "ReportError",
    "build_report",
    "daly_interval",
    "load_events",
    "main",
    "render_png",
    "render_text",
    "young_interval",
]
