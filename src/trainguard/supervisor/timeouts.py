"""Section timeouts: conservative defaults, learned from observed durations, kept in ``timeouts.json``.

Formula (per section, over the durations observed on every local rank, this launch and earlier
ones)::

    timeout = max(min_timeout, safety_factor × P, longest)

where ``P`` is the ``percentile`` (default 99) of the durations, read as the upper edge of its
histogram bucket (≤ 19 % above the true value, see :mod:`trainguard.supervisor.heartbeat`), and
``longest`` the longest duration ever observed. Defaults: ``safety_factor`` 3, ``min_timeout``
2 s, learned once a section has ``min_samples`` (20) observations; until then the configured
starting timeout applies (never "no timeout"). NVIDIA's ft_launcher uses ``max × 5`` for its
estimate; a percentile with a factor tolerates one slow outlier without inflating the timeout for
good, and ``longest`` makes sure a duration that already happened once never times out.

**A section killed as hung** leaves its silence behind (:meth:`TimeoutBook.interrupted`): the
section's timeout is at least twice the longest such silence from then on (this launch's later
attempts and, through ``timeouts.json``, later launches). A section that was only slower than its
timeout (a save to a file system that stalls, a step behind a slow remote store, without CPU or I/O
evidence on this host) then finishes on the restart instead of hitting the same wall; doubling is
exponential back-off: any finite duration is reached in a few restarts, and a true hang costs at
most twice the previous wait.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

from ..atomic import write_atomic
from ..config import SupervisorSection
from .heartbeat import NBUCKETS, OUT_OF_SECTION, bucket_upper

BUILTIN = ("setup", "step", "checkpointing", OUT_OF_SECTION)
INITIAL = "initial"  # process start → first heartbeat: timed by the supervisor only, never learned
TEARDOWN = "teardown"  # after the last step: once per process, never learned
FILENAME = "timeouts.json"


def percentile_of(buckets: list[int], q: float) -> Optional[float]:
    """Upper edge (seconds) of the bucket holding the ``q``-th percentile; None if empty."""
    total = sum(buckets)
    if total == 0:
        return None
    rank = q / 100 * total
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= rank:
            return bucket_upper(i)
    return bucket_upper(len(buckets) - 1)


def _section_record(rec: Any) -> Optional[list]:
    """``[count, longest, buckets]`` from one section of ``timeouts.json``, or ``None`` when it is
    not of that shape (a hand-edited or foreign file: that section starts from the defaults)."""
    if not isinstance(rec, dict):
        return None
    count, longest, buckets = rec.get("count", 0), rec.get("longest", 0.0), rec.get("buckets", [])
    interrupted = rec.get("interrupted", 0.0)
    numbers = isinstance(count, int) and isinstance(buckets, list)
    numbers = numbers and all(
        isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in (longest, interrupted)
    )
    if not numbers or not all(isinstance(b, int) and b >= 0 for b in buckets) or count < 0:
        return None
    buckets = buckets[:NBUCKETS]
    return [count, float(longest), buckets + [0] * (NBUCKETS - len(buckets)), float(interrupted)]


class TimeoutBook:
    """Observed durations per section and the timeouts they give.

    Args:
        cfg: the ``[supervisor]`` section.
        history: ``timeouts.json`` of an earlier launch (its histograms are the starting point).
    """

    def __init__(self, cfg: SupervisorSection, history: Optional[dict] = None):
        self.cfg = cfg
        # section -> [count, longest, buckets]; "base" = closed attempts + earlier launches
        self.base: dict[str, list] = {}
        self.killed_at: dict[str, float] = {}  # section -> the longest silence it was killed at as hung
        sections = (history or {}).get("sections") or {}
        for name, rec in sections.items() if isinstance(sections, dict) else ():
            parsed = _section_record(rec)
            if parsed is not None:
                self.base[str(name)] = parsed[:3]
                if parsed[3]:
                    self.killed_at[str(name)] = parsed[3]
        self.live: dict[str, list] = {}

    @classmethod
    def load(cls, cfg: SupervisorSection, run_dir: Path) -> TimeoutBook:
        """Start from ``run_dir/timeouts.json`` if it exists and parses, else from the defaults."""
        try:
            history = json.loads((run_dir / FILENAME).read_text())
        except (FileNotFoundError, json.JSONDecodeError, OSError):
            history = None
        return cls(cfg, history if isinstance(history, dict) else None)

    def set_live(self, per_rank: list[dict[str, tuple[int, float, list[int]]]]) -> None:
        """Replace the running attempt's observations with the ranks' current histograms."""
        live: dict[str, list] = {}
        for hist in per_rank:
            for name, (count, longest, buckets) in hist.items():
                rec = live.setdefault(name, [0, 0.0, [0] * NBUCKETS])
                rec[0] += count
                rec[1] = max(rec[1], longest)
                rec[2] = [a + b for a, b in zip(rec[2], buckets)]
        self.live = live

    def close_attempt(self) -> None:
        """Fold the running attempt's observations into the base (before a restart)."""
        for name, (count, longest, buckets) in self.live.items():
            rec = self.base.setdefault(name, [0, 0.0, [0] * NBUCKETS])
            rec[0] += count
            rec[1] = max(rec[1], longest)
            rec[2] = [a + b for a, b in zip(rec[2], buckets)]
        self.live = {}

    def observed(self, name: str) -> tuple[int, float, list[int]]:
        """(count, longest, buckets) of a section over base + live."""
        b = self.base.get(name, [0, 0.0, [0] * NBUCKETS])
        l = self.live.get(name, [0, 0.0, [0] * NBUCKETS])
        return b[0] + l[0], max(b[1], l[1]), [x + y for x, y in zip(b[2], l[2])]

    def default(self, name: str) -> float:
        """The configured starting timeout of a section (seconds)."""
        c = self.cfg
        fixed = {
            "setup": c.setup_timeout,
            "step": c.step_timeout,
            "checkpointing": c.checkpointing_timeout,
            OUT_OF_SECTION: c.out_of_section_timeout,
            INITIAL: c.initial_timeout,
            TEARDOWN: c.teardown_timeout,
        }
        return fixed.get(name, c.section_timeouts.get(name, c.user_section_timeout))

    def learned(self, name: str) -> Optional[float]:
        """The learned timeout (formula in the module doc), or None before ``min_samples``."""
        count, longest, buckets = self.observed(name)
        if not self.cfg.learn or count < self.cfg.min_samples or name == TEARDOWN:
            return None
        p = percentile_of(buckets, self.cfg.percentile) or 0.0
        return max(self.cfg.min_timeout, self.cfg.safety_factor * p, longest)

    def interrupted(self, name: str, seconds: float) -> None:
        """Section ``name`` was killed as hung after ``seconds`` of silence: from now on its
        timeout is at least twice that (see the module doc)."""
        self.killed_at[name] = max(self.killed_at.get(name, 0.0), seconds)

    def timeout(self, name: str) -> float:
        """The timeout in force for a section: learned if available, else the starting one; at
        least twice the longest silence it was killed at (:meth:`interrupted`)."""
        learned = self.learned(name)
        return max(self.default(name) if learned is None else learned, 2 * self.killed_at.get(name, 0.0))

    def snapshot(self) -> dict:
        """The content of ``timeouts.json``: timeouts in force and the histograms behind them."""
        names = sorted(set(self.base) | set(self.live) | set(self.killed_at) | set(BUILTIN))
        sections = {}
        for name in names:
            count, longest, buckets = self.observed(name)
            sections[name] = {
                "timeout": self.timeout(name),
                "learned": self.learned(name) is not None,
                "count": count,
                "longest": longest,
                "buckets": buckets,
                "interrupted": self.killed_at.get(name, 0.0),
            }
        return {
            "updated": time.time(),
            "formula": f"max(min_timeout={self.cfg.min_timeout}, safety_factor={self.cfg.safety_factor} × "
            f"p{self.cfg.percentile:g}, longest) once count >= {self.cfg.min_samples}; at least 2 × interrupted",
            "out_of_section": self.timeout(OUT_OF_SECTION),
            "initial": self.timeout(INITIAL),
            "sections": sections,
        }

    def save(self, run_dir: Path) -> None:
        """Write ``run_dir/timeouts.json`` atomically (temp file, fsync, rename)."""
        write_atomic(run_dir / FILENAME, json.dumps(self.snapshot(), indent=1))
