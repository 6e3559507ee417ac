"""Evidence that a silent rank is busy, not hung: the CPU time its main thread keeps using.

A rank can be silent (no heartbeat, no section change) past its timeout for two reasons. It is
*hung* (stopped, deadlocked on a lock, blocked in a collective whose peer is gone): then its main
thread uses no CPU. Or it is *busy* in work the supervisor has not learned yet (a rank-0-only
evaluation, a long first compile, a periodic export): then its main thread runs. The monitor
samples each rank's main-thread CPU time (``utime + stime`` of ``/proc/PID/task/PID/stat``, in
clock ticks; one small file read per rank and sample) and calls a rank **busy** when, over the
last :data:`WINDOW` seconds, its main thread used at least :data:`BUSY_SHARE` of one core.

Why the main thread: the background threads of a rank (the liveness ping, the checkpoint writer,
gloo's and NCCL's own threads, intra-op worker pools) run while the main thread is stuck, so the
process's total CPU time is no evidence. The threshold is low (a quarter of a core) because on a
loaded node a busy rank gets a fraction of a core; a main thread that sleeps in a collective, on a
lock or stopped by a signal uses none.

Limit (documented in docs/supervisor.md): a host thread that *spins* while it waits, as CUDA's
default synchronization does when there are fewer CUDA contexts than cores, looks busy. A rank
hung behind a stuck NCCL collective is then only called hung after ``[supervisor] busy_timeout``
(NCCL's own watchdog, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, usually ends it first).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Optional

WINDOW = 1.0  # seconds of history a verdict looks at
BUSY_SHARE = 0.25  # share of one core the main thread must use over WINDOW to count as busy
SAMPLE_EVERY = 0.2  # seconds between samples of one rank
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def main_thread_cpu(pid: int) -> Optional[float]:
    """CPU seconds (user + system) the main thread of process ``pid`` has used so far; ``None``
    when it cannot be read (the process is gone, or no ``/proc``: not Linux)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
    fields = text[text.rindex(b")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15 of stat(5)
    except (IndexError, ValueError):
        return None


class CpuMeter:
    """Recent main-thread CPU samples of a set of processes.

    Call :meth:`sample` on every poll (it reads a process at most every :data:`SAMPLE_EVERY`
    seconds) and :meth:`share` for a verdict.
    """

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[float, float]]] = {}

    def sample(self, pid: int, now: float) -> None:
        """Record ``pid``'s main-thread CPU time at monotonic time ``now`` (seconds)."""
        samples = self._samples.setdefault(pid, deque())
        if samples and now - samples[-1][0] < SAMPLE_EVERY:
            return
        cpu = main_thread_cpu(pid)
        if cpu is None:
            return
        samples.append((now, cpu))
        while len(samples) > 2 and now - samples[1][0] >= WINDOW:
            samples.popleft()

    def share(self, pid: int) -> Optional[float]:
        """Share of one core ``pid``'s main thread used over about the last :data:`WINDOW`
        seconds (0.0–1.0 and a little over, from clock ticks); ``None`` with under half a window
        of samples."""
        samples = self._samples.get(pid)
        if not samples or samples[-1][0] - samples[0][0] < WINDOW / 2:
            return None
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        return (c1 - c0) / (t1 - t0)

    def busy(self, pid: Optional[int]) -> bool:
        """Whether ``pid``'s main thread used at least :data:`BUSY_SHARE` of a core lately."""
        share = self.share(pid) if pid is not None else None
        return share is not None and share >= BUSY_SHARE
