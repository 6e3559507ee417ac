"""Rank → supervisor progress reports through shared memory: heartbeats, sections, durations.

Each rank owns one small file in a node-local directory (``/dev/shm`` when it exists), mapped with
``mmap``. The training loop's main thread writes it with ``struct.pack_into`` (a memory copy: no
system call, no lock, never blocks); the supervisor on the same node maps the same file read-only
and polls it. Because only the main thread writes, and only when the loop makes progress, a rank
whose process is alive but whose main thread is stuck (a collective, I/O, a deadlock) stops
updating its record: that is how a hang is seen.

Layout (little-endian, offsets in bytes)::

    0    seq     : u64, odd while the writer is updating the state
    8    state   : step u64, beats u64, beat_time f64, entered f64, last_closed f64, section 24s
    128  table   : MAX_SECTIONS × (name 24s, count u64, max f64, buckets NBUCKETS × u32)

``seq`` is a seqlock: the writer makes it odd, writes the state, makes it even (three separate
stores, which x86 and ARM keep in program order for another process reading through the same
mapping as long as the reader's loads are ordered too: Python's bytecode boundaries and the
separate ``unpack_from`` calls give that in practice); the reader accepts a snapshot only when
``seq`` was even and unchanged around its copy, so it never mixes two updates. Times are ``time.monotonic()`` seconds (the
same clock for every process of a host). ``entered`` is 0 outside any section; ``last_closed`` is
when the last section closed (out-of-section time counts from it).

Durations are kept per section in a log-scale histogram: bucket ``i`` holds durations in
``[BASE·2^(i/4), BASE·2^((i+1)/4))`` with ``BASE`` = 1 ms, i.e. 4 buckets per doubling (each bucket
≤ 19 % wide) from 1 ms to ~4.7 hours (longer durations land in the last bucket); see :mod:`trainguard.supervisor.timeouts` for how timeouts are
learned from them.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

STATE = struct.Struct("<QQddd24s")
STATE_OFFSET = 8
TABLE_OFFSET = 128
MAX_SECTIONS = 16
NBUCKETS = 96
BASE = 1e-3  # seconds: lower edge of bucket 0
OUT_OF_SECTION = "out_of_section"  # the name under which time between sections is recorded
ENTRY = struct.Struct(f"<24sQd{NBUCKETS}I")
SIZE = TABLE_OFFSET + MAX_SECTIONS * ENTRY.size
_COUNT_MAX = struct.Struct("<Qd")
_U32 = struct.Struct("<I")


def bucket_of(seconds: float) -> int:
    """Histogram bucket of a duration (clamped to [0, NBUCKETS - 1])."""
    if seconds <= BASE:
        return 0
    return min(NBUCKETS - 1, int(4 * math.log2(seconds / BASE)))


def bucket_upper(index: int) -> float:
    """Upper edge (seconds) of a bucket."""
    return BASE * 2 ** ((index + 1) / 4)


def heartbeat_path(directory: str | os.PathLike, local_rank: int) -> Path:
    """The record of one local rank inside the launch's heartbeat directory."""
    return Path(directory) / f"rank-{local_rank}.hb"


class HeartbeatWriter:
    """The rank side. Cost per call: a few ``struct.pack_into`` (≈ 1 µs each, see the benchmark).

    Args:
        path: this rank's record (created, sized, zeroed and allocated).
    Raises:
        OSError: the file cannot be created or its pages allocated (a full file system).
    """

    def __init__(self, path: str | os.PathLike):
        # never truncated: the launcher may have the record of an earlier Guard of this process
        # mapped, and a read past the end of a file truncated under it ends the launcher with SIGBUS
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # the pages are allocated now: a sparse file on a full memory file system would end the
            # rank with SIGBUS at the first write to a new page, mid-run; this raises ENOSPC here
            os.posix_fallocate(fd, 0, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        # seq is read and written through an 8-byte view: struct.pack_into would zero the field
        # before writing it, and a reader could see that transient 0 as an even sequence number
        self._seqv = memoryview(self._mm)[:8].cast("Q")
        self._seqv[0] = 1  # odd: being written, while an earlier record's contents are zeroed
        self._mm[8:SIZE] = bytes(SIZE - 8)
        self._seq = 0
        self.step = 0
        self._beats = 0
        self._beat_time = 0.0
        self._last_closed = time.monotonic()
        self._stack: list[tuple[str, float]] = []
        self._slots: dict[str, int] = {}
        self.beat(0)

    def _publish(self) -> None:
        name, entered = self._stack[-1] if self._stack else ("", 0.0)
        self._seqv[0] = self._seq + 1  # odd: update in progress (one aligned 8-byte store)
        STATE.pack_into(
            self._mm,
            STATE_OFFSET,
            self.step,
            self._beats,
            self._beat_time,
            entered,
            self._last_closed,
            name.encode()[:24],
        )
        self._seq += 2
        self._seqv[0] = self._seq  # even: consistent

    def resumed(self, step: int) -> None:
        """The process resumed at ``step`` completed steps (a checkpoint, a just-in-time save, a
        replacement's state): the record names that step, without a beat, so that a failure
        before its first boundary is placed at ``step + 1`` (the launcher's give-up rule), not at
        step 1."""
        self.step = step
        self._publish()

    def beat(self, step: int) -> None:
        """A heartbeat: the loop reached a step boundary (``step`` completed steps)."""
        self.step = step
        self._beats += 1
        self._beat_time = time.monotonic()
        self._publish()

    def open(self, name: str) -> None:
        """Enter section ``name`` (nested sections form a stack; the innermost one is timed, and an
        outer section's time, its learned timeout and its silence leave out the time spent in the
        sections nested in it).

        Entering from outside any section also records the out-of-section time since the last close.
        """
        now = time.monotonic()
        if not self._stack:
            self._record(OUT_OF_SECTION, now - self._last_closed)
        self._stack.append((name, now))
        self._publish()

    def close(self) -> float:
        """Leave the innermost section; record its duration; return it in seconds.

        Raises:
            RuntimeError: no section is open.
        """
        seconds = self._leave()
        self._publish()
        return seconds

    def close_and_beat(self, step: int) -> None:
        """:meth:`close` and :meth:`beat` in one update of the record (the end of a step).

        Raises:
            RuntimeError: no section is open.
        """
        self._leave()
        self.beat(step)

    def _leave(self) -> float:
        if not self._stack:
            raise RuntimeError("close() without an open section")
        name, entered = self._stack.pop()
        now = time.monotonic()
        self._last_closed = now
        self._record(name, now - entered)
        if self._stack:  # the outer section's time leaves out this one's: a slow eval is the eval's, not the step's
            outer, outer_entered = self._stack[-1]
            self._stack[-1] = (outer, outer_entered + (now - entered))
        return now - entered

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """``with writer.section("eval"): ...``"""
        self.open(name)
        try:
            yield
        finally:
            self.close()

    @property
    def current(self) -> Optional[str]:
        """Name of the innermost open section, or None."""
        return self._stack[-1][0] if self._stack else None

    def _record(self, name: str, seconds: float) -> None:
        slot = self._slots.get(name)
        if slot is None:
            if len(self._slots) >= MAX_SECTIONS:
                return  # more distinct sections than slots: not learned, still timed
            slot = self._slots[name] = len(self._slots)
            ENTRY.pack_into(self._mm, TABLE_OFFSET + slot * ENTRY.size, name.encode()[:24], 0, 0.0, *([0] * NBUCKETS))
        base = TABLE_OFFSET + slot * ENTRY.size
        count, longest = _COUNT_MAX.unpack_from(self._mm, base + 24)
        _COUNT_MAX.pack_into(self._mm, base + 24, count + 1, max(longest, seconds))
        at = base + 40 + 4 * bucket_of(seconds)
        _U32.pack_into(self._mm, at, _U32.unpack_from(self._mm, at)[0] + 1)

    def close_file(self) -> None:
        """Unmap the record."""
        self._seqv.release()
        self._mm.close()


class RankState:
    """One consistent snapshot of a rank's record (see the module doc for the fields)."""

    __slots__ = ("step", "beats", "beat_time", "entered", "last_closed", "section")

    def __init__(self, step: int, beats: int, beat_time: float, entered: float, last_closed: float, section: str):
        self.step, self.beats, self.beat_time = step, beats, beat_time
        self.entered, self.last_closed, self.section = entered, last_closed, section


class HeartbeatReader:
    """The supervisor side: maps a rank's record read-only.

    Raises:
        FileNotFoundError: the rank has not created its record yet.
    """

    def __init__(self, path: str | os.PathLike):
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size < SIZE:
                raise FileNotFoundError(f"{path} is not initialised yet")
            self._mm = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._seqv = memoryview(self._mm)[:8].cast("Q")
        if self._seqv[0] == 0:  # sized but never written (the writer's first publish makes it 2)
            self.close()
            raise FileNotFoundError(f"{path} is not initialised yet")

    def state(self, retries: int = 100) -> Optional[RankState]:
        """A consistent snapshot, or None if the writer kept changing it (retried ``retries`` times)."""
        for _ in range(retries):
            seq1 = self._seqv[0]
            if seq1 % 2:
                continue
            step, beats, beat_time, entered, last_closed, name = STATE.unpack_from(self._mm, STATE_OFFSET)
            if self._seqv[0] == seq1:
                return RankState(
                    step, beats, beat_time, entered, last_closed, name.rstrip(b"\0").decode(errors="replace")
                )
        return None

    def histograms(self) -> dict[str, tuple[int, float, list[int]]]:
        """``{section: (count, max seconds, bucket counts)}`` of the durations recorded so far."""
        out = {}
        for slot in range(MAX_SECTIONS):
            name, count, longest, *buckets = ENTRY.unpack_from(self._mm, TABLE_OFFSET + slot * ENTRY.size)
            name = name.rstrip(b"\0").decode(errors="replace")
            if not name:
                break
            out[name] = (count, longest, list(buckets))
        return out

    def close(self) -> None:
        """Unmap the record."""
        self._seqv.release()
        self._mm.close()
