"""Evidence that a silent rank is busy, not hung: its main thread keeps wanting the CPU.

A rank can be silent (no heartbeat, no section change) past its timeout for two reasons. It is
*hung* (stopped, deadlocked on a lock, blocked in a collective whose peer is gone): then its main
thread is not runnable. Or it is *busy* in work the supervisor has not learned yet (a rank-0-only
evaluation, a long first compile, a periodic export): then its main thread runs, or waits in the
run queue for a core. The monitor samples each rank's main thread from
``/proc/PID/task/PID/schedstat`` (nanoseconds on a CPU, nanoseconds runnable but waiting for one;
one small file read per rank and sample) and calls a rank **busy** when, over the last
:data:`WINDOW` seconds, its main thread was running or runnable at least :data:`BUSY_SHARE` of the
time (its *demand*), or its own system calls moved bytes (``/proc/PID/task/PID/io``: a read from a
slow shared file system that makes progress is slow, not hung; a read of a hung mount moves none). On an oversubscribed host a spinning thread gets a third of a core and waits
the rest in the run queue: its demand is still close to 1, where its CPU share alone (0.15 with six
runnable processes on two cores, measured) fell under any fixed threshold. Where ``schedstat`` is
missing (a kernel without ``CONFIG_SCHEDSTATS``), the CPU share of ``/proc/PID/task/PID/stat``
stands in for the demand.

Why the main thread: the background threads of a rank (the liveness ping, the checkpoint writer,
gloo's and NCCL's own threads, intra-op worker pools) run while the main thread is stuck, so the
process's total CPU time is no evidence. A main thread that sleeps in a collective, on a lock or
stopped by a signal is neither running nor runnable.

Limit (documented in docs/supervisor.md): a host thread that *spins* while it waits, as CUDA's
default synchronization does when there are fewer CUDA contexts than cores, looks busy. A rank
hung behind a stuck NCCL collective is then only called hung after ``[supervisor] busy_timeout``
(NCCL's own watchdog, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, usually ends it first).

The opposite evidence is certain, and needs no timeout: a rank whose process is *stopped* (state
``T`` in ``/proc/PID/stat``: SIGSTOP, SIGTSTP) cannot run until someone sends it SIGCONT.
:class:`StopWatch` times how long the monitor itself has seen each process stopped; the monitor
reads the state of every rank silent for :data:`LOOK_AFTER` (0.1 s) on each poll and calls it hung
once it has been seen stopped for ``[supervisor] stopped_grace`` (0.3 s), however long its
section's timeout. The time is the monitor's own observation, not the rank's silence, so a whole
job suspended and resumed together (``scontrol suspend``, Ctrl-Z: the launcher stops too) is not
mistaken for a hang: after the SIGCONT the ranks run again within milliseconds. A process stopped
by a debugger (``t``, tracing stop) is not counted: someone is looking at it.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Optional

WINDOW = 1.0  # seconds of history a verdict looks at
BUSY_SHARE = 0.25  # share of the time the main thread must be running or runnable over WINDOW to count as busy
SAMPLE_EVERY = 0.2  # seconds between samples of one rank
LOOK_AFTER = 0.1  # seconds of silence after which the monitor reads whether a rank's process is stopped
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


def main_thread_io(pid: int) -> Optional[int]:
    """Bytes the main thread of ``pid`` has read and written so far, through any system call
    (``rchar + wchar`` of ``/proc/PID/task/PID/io``); ``None`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/task/{pid}/io", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields[b"rchar"]) + int(fields[b"wchar"])
    except (OSError, KeyError, ValueError):
        return None


def main_thread_sched(pid: int) -> Optional[tuple[float, float]]:
    """``(seconds on a CPU, seconds runnable waiting for one)`` of the main thread of ``pid`` so
    far (``/proc/PID/task/PID/schedstat``); ``None`` when it cannot be read (no such process, or a
    kernel without schedstats)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat", "rb") as f:
            running, waiting = f.read().split()[:2]
        return int(running) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of process ``pid`` (``/proc/PID/stat``, see proc(5): ``R`` running,
    ``S`` sleeping, ``D`` uninterruptible, ``T`` stopped, ``t`` tracing stop, ``Z`` zombie);
    ``None`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    try:
        return chr(text[text.rindex(b")") + 2])  # after "pid (comm) ": comm may hold ")"
    except (ValueError, IndexError):
        return None


class StopWatch:
    """How long the monitor has seen each process stopped (state ``T``) without a break.

    :meth:`seconds` is called on each poll for the silent ranks; a process seen running in between
    starts from zero again.
    """

    def __init__(self) -> None:
        self._since: dict[int, float] = {}  # pid -> monotonic time it was first seen stopped

    def seconds(self, pid: Optional[int], now: float) -> float:
        """Seconds ``pid`` has been seen stopped up to monotonic time ``now`` (0.0 when it is not
        stopped now, or cannot be read)."""
        if pid is None or process_state(pid) != "T":
            self._since.pop(pid, None)
            return 0.0
        return now - self._since.setdefault(pid, now)


class CpuMeter:
    """Recent main-thread samples of a set of processes.

    Call :meth:`sample` on every poll (it reads a process at most every :data:`SAMPLE_EVERY`
    seconds) and :meth:`busy` for a verdict.
    """

    def __init__(self) -> None:
        # pid -> (monotonic time, CPU seconds, CPU + run-queue seconds or None without schedstat,
        # bytes read and written or None)
        self._samples: dict[int, deque[tuple[float, float, Optional[float], Optional[int]]]] = {}

    def sample(self, pid: int, now: float) -> None:
        """Record ``pid``'s main-thread CPU and run-queue times at monotonic time ``now`` (seconds)."""
        samples = self._samples.setdefault(pid, deque())
        if samples and now - samples[-1][0] < SAMPLE_EVERY:
            return
        sched = main_thread_sched(pid)
        cpu = sched[0] if sched is not None else main_thread_cpu(pid)
        if cpu is None:
            return
        samples.append((now, cpu, None if sched is None else sched[0] + sched[1], main_thread_io(pid)))
        while len(samples) > 2 and now - samples[1][0] >= WINDOW:
            samples.popleft()

    def _window(self, pid: Optional[int]) -> Optional[tuple[tuple, tuple]]:
        samples = self._samples.get(pid) if pid is not None else None
        if not samples or samples[-1][0] - samples[0][0] < WINDOW / 2:
            return None
        return samples[0], samples[-1]

    def share(self, pid: Optional[int]) -> Optional[float]:
        """Share of one core ``pid``'s main thread used over about the last :data:`WINDOW`
        seconds (0.0–1.0 and a little over); ``None`` with under half a window of samples."""
        w = self._window(pid)
        return None if w is None else (w[1][1] - w[0][1]) / (w[1][0] - w[0][0])

    def demand(self, pid: Optional[int]) -> Optional[float]:
        """Share of the last :data:`WINDOW` seconds ``pid``'s main thread was running or runnable
        (its CPU share where the kernel keeps no run-queue times); ``None`` with under half a
        window of samples."""
        w = self._window(pid)
        if w is None:
            return None
        if w[0][2] is None or w[1][2] is None:
            return self.share(pid)
        return (w[1][2] - w[0][2]) / (w[1][0] - w[0][0])

    def io(self, pid: Optional[int]) -> Optional[int]:
        """Bytes ``pid``'s main thread read and wrote over about the last :data:`WINDOW` seconds;
        ``None`` with under half a window of samples or no I/O counters."""
        w = self._window(pid)
        if w is None or w[0][3] is None or w[1][3] is None:
            return None
        return w[1][3] - w[0][3]

    def busy(self, pid: Optional[int]) -> bool:
        """Whether ``pid``'s main thread wanted the CPU at least :data:`BUSY_SHARE` of the time
        lately, or moved bytes through its own system calls (I/O that makes progress, however
        slowly: a read from a slow shared file system is slow, not hung)."""
        demand, moved = self.demand(pid), self.io(pid)
        return (demand is not None and demand >= BUSY_SHARE) or (moved is not None and moved > 0)
