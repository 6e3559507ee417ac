"""The structured event log (``RUN_DIR/events.jsonl``) and the hook interface.

Every event is one JSON object on one line::

    {"time": 1732312345.12, "rank": 0, "kind": "checkpoint_committed", "step": 200,
     "attempt": 0, "pid": 4242, "details": {"bytes": 12345, "seconds": 0.41, "path": "..."}}

``time`` is Unix time in seconds, ``rank`` is the global rank (``null`` for the launcher),
``attempt`` the worker-group restart count (``TORCHELASTIC_RESTART_COUNT``). Each event is written
with a single ``write()`` on a file opened with ``O_APPEND``, so lines from several processes never
interleave.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

from . import console
from .launch_env import LaunchEnv

if TYPE_CHECKING:  # this module imports no torch at run time (the CLI reads events without it)
    import torch


class EventLog:
    """Appends events to ``RUN_DIR/events.jsonl``.

    Args:
        run_dir: the run directory (created if missing).
        rank: global rank of the writer, or ``None`` for the launcher.
        attempt: the worker-group restart count the events carry (default: torch's
            ``TORCHELASTIC_RESTART_COUNT``, read now; the Guard passes the one it read).
    """

    FILENAME = "events.jsonl"

    def __init__(self, run_dir: str | os.PathLike, rank: Optional[int] = None, attempt: Optional[int] = None):
        self.path = Path(run_dir) / self.FILENAME
        self.rank = rank
        self.attempt = LaunchEnv.from_environ().restart_count if attempt is None else attempt
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.lost = 0  # events not written since the last one that was (see _write)
        self.lost_error: Optional[str] = None  # why the last one was not
        self.first_lost: Optional[str] = None  # the kind of the first one lost
        self._torn = False  # a write was cut short: the next one starts with a newline

    def renumber(self, rank: int) -> None:
        """Events of this process carry ``rank`` from now on (the group shrank in place)."""
        self.rank = rank

    def emit(self, kind: str, step: Optional[int] = None, /, **details: Any) -> dict:
        """Write one event and return it. ``details`` must be JSON-serializable (``str()`` otherwise)."""
        event = self._event(kind, step, details)
        self._write((json.dumps(event, default=str, separators=(",", ":")) + "\n").encode(), kind)
        return event

    def _event(self, kind: str, step: Optional[int], details: dict) -> dict:
        return {
            "time": round(time.time(), 6),
            "rank": self.rank,
            "kind": kind,
            "step": step,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "details": details,
        }

    def _write(self, data: bytes, kind: str) -> None:
        """Append ``data``; a write the file system refuses (a full disk, a quota, an I/O error)
        is counted, not raised: the run goes on and decides by its own rules (a checkpoint that
        cannot be saved counts against ``[checkpoint] max_failures``). The first such write prints
        one warning; the first write that succeeds again is preceded by an ``events_lost`` event
        with the count. A write cut short leaves a torn line, ended before the next one (readers
        skip it)."""
        try:
            if self.lost:
                lost = {"count": self.lost, "error": self.lost_error, "first_lost": self.first_lost}
                note = self._event("events_lost", None, lost)
                data = (json.dumps(note, separators=(",", ":")) + "\n").encode() + data
            if self._torn:
                data = b"\n" + data
            done = os.write(self._fd, data)
        except OSError as e:
            if e.errno == errno.EBADF:  # closed: a bug of the caller, not the disk
                raise
            done = 0
            error = f"{e.strerror or e} ({self.path})"
        else:
            error = f"short write ({done} of {len(data)} bytes) to {self.path}"
        if done == len(data):
            self.lost, self._torn = 0, False
            return
        self._torn = self._torn or done > 0
        if not self.lost:
            self.first_lost = kind
        self.lost += 1
        if self.lost_error is None:
            console.warn(f"events could not be written: {error}; counting them until the disk has room")
        self.lost_error = error

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (an ``emit`` then fails)."""
        return self._fd < 0

    def close(self) -> None:
        """Close the file (saying how many events were lost, if the last ones were); further
        ``emit`` calls fail."""
        if self.lost:
            console.warn(f"{self.lost} event(s) from {self.first_lost} on were not written: {self.lost_error}")
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def run_dir_problem(run_dir: str | os.PathLike, writable: bool = False) -> Optional[str]:
    """Why ``run_dir`` cannot serve as a run directory to read (or, with ``writable``, to write
    into) — missing, not a directory, unreadable, not writable — or ``None`` when it can."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return f"run directory {run_dir} does not exist"
    if not run_dir.is_dir():
        return f"{run_dir} is not a directory"
    if not os.access(run_dir, os.R_OK | os.X_OK):
        return f"run directory {run_dir} cannot be read (permission denied)"
    if writable and not os.access(run_dir, os.W_OK):
        return f"run directory {run_dir} is not writable"
    return None


def read_events(run_dir: str | os.PathLike, kind: Optional[str] = None) -> Iterator[dict]:
    """Yield the events of a run directory in file order, optionally only one ``kind``.

    Malformed lines (for example a line cut by a crash) are skipped.
    """
    path = Path(run_dir) / EventLog.FILENAME
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or event.get("kind") == kind:
                yield event


class Hook:
    """Base class for Guard hooks: override the methods you need; each default does nothing.

    Hooks run on every rank, in the order they were added, in the training process's main thread.
    """

    def on_train_begin(self, guard: Any) -> None:
        """After resume, before the first step. ``guard.step`` is the first step to run."""

    def on_step_end(self, guard: Any, step: int, loss: Optional[Union[float, torch.Tensor]]) -> None:
        """After ``guard.step_end()``; ``step`` is the number of completed steps; ``loss`` is what
        ``step_end`` was given, as given: usually the step's loss tensor (0-dim, on the training
        device: ``float(loss)`` copies it to the host, a synchronization on CUDA, which trainguard
        does not do for you), a float, or ``None``."""

    def on_checkpoint_save(self, guard: Any, step: int, path: Path) -> None:
        """After a checkpoint is committed (visible to ``latest_valid()``)."""

    def on_train_end(self, guard: Any, reason: str) -> None:
        """Before the process leaves the training loop; ``reason`` is 'finished' or the stop reason."""

    def on_instability(self, guard: Any, event: dict) -> Optional[str]:
        """A detector fired in ``guard.should_step()``: return an action to override the policy's
        (``"warn"``, ``"skip"``, ``"rollback"``, ``"raise"``), or ``None`` to keep it.

        ``event`` holds ``step`` (1-based step in progress), ``detectors`` (names that fired),
        ``loss`` and ``grad_norm`` (means over ranks), ``thresholds``, ``ranks``, ``policies``,
        ``action`` (the policy's decision) and ``consecutive`` (skipped steps in a row). Rank 0's
        answer is used on every rank. Non-finite gradients are never applied: ``"warn"`` then
        means ``"skip"``. Example, roll back at once on a NaN after step 10,000::

            class Strict(trainguard.Hook):
                def on_instability(self, guard, event):
                    if "nonfinite_loss" in event["detectors"] and event["step"] > 10_000:
                        return "rollback"
                    return None
        """
        return None

    def on_rollback(self, guard: Any, from_step: int, to_step: int) -> None:
        """After a rollback from step number ``from_step`` (the bad step) to the checkpoint of step
        ``to_step``: the state is reloaded and the next step yielded is ``to_step``."""
