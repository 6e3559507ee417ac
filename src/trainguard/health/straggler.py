"""Straggler detection (``[straggler]``): which rank is slow, on which host, at no measurable cost.

Each rank times its steps on the host — and, under ``guard.run_step``, the *compute* of each step
(forward and backward, without waiting for the gradient all-reduce), which is what differs between
ranks of a synchronous data-parallel job: the whole-step time is the same on every rank, since the
fast ones wait for the slow one inside the all-reduce. On CUDA the compute is timed with CUDA
events, read only once they have completed (``Event.query()``), so timing never stalls the step.

The first ``warmup_steps`` steps (allocation, first-iteration work) are not timed. Every
report interval (``report_interval`` seconds, converted to steps from the slowest rank's
measured step time, or ``report_interval_steps``) the ranks exchange the median of their window in
the Guard's stop-check all-reduce (one slot per rank; no extra collective), and every rank computes
the same scores, the NVIDIA Resiliency Extension's definitions (``nvidia_resiliency_ext``
straggler detection, "performance scores"):

* relative score = the fastest rank's median / this rank's median (1.0 = the fastest rank);
* individual score = this rank's typical median (the median of its last 16 earlier windows'
  medians) / its current median (1.0 = as fast as usual). NVRx compares with the best window
  ever; on a shared machine one lucky window then makes every later one look slow (a clean run
  of 5 ms steps scored 0.65-0.70), so the baseline here is robust to a single outlier.

A rank under ``relative_threshold`` or ``individual_threshold`` (0.7 each by default, as there) is
a straggler: a ``straggler_detected`` event names its rank and host; each report is a
``straggler_report`` event with the worst and best ``report_ranks`` ranks. With
``stop_if_detected`` the run saves, writes the stragglers' hosts to ``RUN_DIR/exclude_nodes`` and
exits with the requeue code, so the next submission can exclude them (``sbatch --exclude``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

import torch

from ..events import EventLog
from ..ranks import HostsView
from ..rundir import exclude_hosts
from ..sections import StragglerSection

US = 1_000_000  # medians travel as integer microseconds
HISTORY = 16  # earlier window medians the individual score compares with


class ComputeTimer:
    """Times one region per step: host clock on CPU, CUDA events on GPU (resolved without a sync)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Any, Any]] = []
        self._start: Any = None

    def start(self) -> None:
        """Mark the start of the region."""
        self.t0 = time.perf_counter()
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def stop(self) -> Optional[float]:
        """Mark the end; returns the seconds on CPU, ``None`` on CUDA (read later by :meth:`ready`)."""
        if not self.cuda:
            return time.perf_counter() - self.t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((self._start, end))
        return None

    def ready(self) -> list[float]:
        """Seconds of the CUDA regions that have completed (oldest first); never waits."""
        done = []
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.pop(0)
            done.append(start.elapsed_time(end) / 1000.0)
        return done


class StragglerDetector:
    """Per-rank step and compute timings, exchanged and scored at report checks.

    Args:
        cfg: the ``[straggler]`` section.
        world: this rank, the group size and every rank's host name (index = rank), read at each
            use (:class:`~trainguard.ranks.HostsView`: the Guard's shared world, whose hosts are
            gathered at the start and which a shrink or growth changes; :meth:`group_resized` then).
        events: where reports and detections go.
        run_dir: ``exclude_nodes`` is written there.
    """

    def __init__(self, cfg: StragglerSection, world: HostsView, events: EventLog, run_dir: Path):
        self.cfg, self.world, self.events, self.run_dir = cfg, world, events, run_dir
        self.active = cfg.enabled and world.world_size > 1  # one rank has no peers to compare with: time nothing
        self.seen = 0  # steps completed (the first warmup_steps are not timed)
        self.steps: list[float] = []  # whole-step seconds in this window
        self.compute: list[float] = []  # compute seconds in this window (run_step)
        self.history: deque[float] = deque(maxlen=HISTORY)  # this rank's earlier window medians (seconds)
        self.next_report: Optional[int] = None  # step of the next report (identical on every rank)
        self.timer: Optional[ComputeTimer] = None
        self.measure = "step"  # what the last window timed: "compute" (run_step) or "step"
        self._packed: Optional[tuple[int, list[int]]] = None  # (report step, what pack(step) gave)

    def group_resized(self) -> None:
        """The group changed size in place (``world`` holds the new rank, size and hosts): a report
        packed for the old group is dropped (the current window's timings are kept); one rank left
        times nothing from now on."""
        self.active = self.active and self.world.world_size > 1
        self._packed = None

    @property
    def hosts(self) -> list[str]:
        """Every rank's host name (index = rank), as the shared world holds it."""
        return self.world.hosts

    def hosts_of(self, ranks: list[int]) -> list[str]:
        """The distinct hosts of ``ranks``, sorted."""
        return sorted({self.hosts[r] for r in ranks})

    def compute_timer(self, device: torch.device) -> ComputeTimer:
        """The timer ``run_step`` wraps its compute in (created once, for the training device)."""
        if self.timer is None:  # inactive: a host clock (CUDA events would pile up unread)
            self.timer = ComputeTimer(device if self.active else torch.device("cpu"))
        return self.timer

    def record_step(self, seconds: float) -> None:
        """One whole step's wall time (from the Guard)."""
        self.seen += 1
        if self.active and self.seen > self.cfg.warmup_steps:
            self.steps.append(seconds)

    def record_compute(self, seconds: Optional[float]) -> None:
        """One step's compute time (from ``run_step``; ``None`` on CUDA: read from the timer later)."""
        if self.active and seconds is not None and self.seen >= self.cfg.warmup_steps:
            self.compute.append(seconds)

    def due(self, step: int) -> bool:
        """Whether the stop check at ``step`` carries a report (the same answer on every rank)."""
        if not self.active:
            return False
        if self.next_report is None:
            self.next_report = self.cfg.warmup_steps + (self.cfg.report_interval_steps or self.cfg.min_samples)
        return step >= self.next_report

    def pack(self, step: Optional[int] = None) -> list[int]:
        """This rank's part of the exchange, combined by max across ranks: [slowest step (µs),
        window medians (µs, one slot per rank), individual scores (× 10⁴, one slot per rank)];
        this rank fills only its own slots (0 = not enough samples). It closes the window: with
        ``step`` given, a second call for the same report step returns the same values (the
        report's timings sent in a gradient bucket, then all-reduced where the bucket did not
        carry every rank's)."""
        if step is not None and self._packed is not None and self._packed[0] == step:
            return self._packed[1]
        packed = self._pack()
        if step is not None:
            self._packed = (step, packed)
        return packed

    def _pack(self) -> list[int]:
        if self.timer is not None:
            self.compute.extend(self.timer.ready())
        window = self.compute if self.compute else self.steps
        n, me = self.world.world_size, self.world.rank
        medians, individual = [0] * n, [0] * n
        if len(window) >= self.cfg.min_samples:
            mine = statistics.median(window)
            medians[me] = max(1, int(mine * US))
            usual = statistics.median(self.history) if self.history else mine
            individual[me] = int(min(1.0, usual / mine) * 10_000)
            self.history.append(mine)
        self.measure = "compute" if self.compute else "step"
        slowest = max(self.steps, default=0.0)
        self.steps, self.compute = [], []
        return [int(slowest * US)] + medians + individual

    def unpack(self, step: int, agreed: list[int]) -> list[int]:
        """Score the exchanged values, write the events, schedule the next report.

        Returns:
            The straggling ranks (the same list on every rank).
        """
        w = self.world.world_size
        slowest_step, medians, individual = agreed[0] / US, agreed[1 : 1 + w], agreed[1 + w : 1 + 2 * w]
        interval = self.cfg.report_interval_steps or math.ceil(self.cfg.report_interval / max(slowest_step, 1e-6))
        self.next_report = step + max(interval, self.cfg.min_samples)
        known = {r: m / US for r, m in enumerate(medians) if m > 0}
        if len(known) < 2:
            return []
        fastest = min(known.values())
        rows = sorted(
            (
                {
                    "rank": r,
                    "host": self.hosts[r],
                    "median_ms": round(m * 1e3, 3),
                    "relative": round(fastest / m, 4),
                    "individual": round(individual[r] / 10_000, 4),
                }
                for r, m in known.items()
            ),
            key=lambda row: (row["relative"], row["individual"]),
        )
        c = self.cfg
        flagged = [
            row for row in rows if row["relative"] < c.relative_threshold or row["individual"] < c.individual_threshold
        ]
        if self.world.rank == 0:
            self.events.emit(
                "straggler_report",
                step,
                measure=self.measure,
                window_steps=interval,
                worst=rows[: c.report_ranks],
                best=rows[::-1][: c.report_ranks],
                stragglers=[row["rank"] for row in flagged],
                relative_threshold=c.relative_threshold,
                individual_threshold=c.individual_threshold,
            )
            for row in flagged:
                self.events.emit(
                    "straggler_detected",
                    step,
                    measure=self.measure,
                    relative_threshold=c.relative_threshold,
                    individual_threshold=c.individual_threshold,
                    **row,
                )
        return [row["rank"] for row in flagged]

    def write_exclude(self, ranks: list[int]) -> Path:
        """Append the hosts of ``ranks`` to ``RUN_DIR/exclude_nodes`` (one per line, no duplicates)."""
        return exclude_hosts(self.run_dir, [self.hosts[r] for r in ranks])
