"""The job's end time as the ranks see it, kept current while the job runs.

``trainguard run`` under SLURM gives its ranks the time by which they must have saved and exited:
the job's ``EndTime`` minus ``[slurm] end_margin``. It reaches them two ways:

* ``TRAINGUARD_END_TIME`` (Unix seconds) in their environment: what this node's launcher read from
  ``scontrol show job`` at start;
* the file named by ``TRAINGUARD_END_TIME_FILE`` (``RUN_DIR/.slurm_end_time.<job>.<restart>``), which
  the launcher on the job's first node writes at start and rewrites when a re-read of ``scontrol
  show job`` (every ``[slurm] end_time_refresh`` seconds) shows another EndTime, for example after
  ``scontrol update JobId=... TimeLimit=...``. The ranks re-read it when its modification time
  changes (one ``stat`` per stop check). An empty file means: no end time (unlimited).

The file name carries the job and restart count, so a requeued job never reads its previous
run's (past) end time; the first node deletes the files of earlier runs.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Mapping, Optional

from ..atomic import write_atomic
from ..events import EventLog
from ..launch_env import LaunchEnv
from .info import SlurmError, SLURMInfo, parse_slurm_time, parse_slurm_timestamp, show_job

PREFIX = ".slurm_end_time."


def _float(text: Optional[str]) -> Optional[float]:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def end_time_file(run_dir: Path, info: SLURMInfo) -> Path:
    """``RUN_DIR/.slurm_end_time.<requeue id>.<restart count>``."""
    return Path(run_dir) / f"{PREFIX}{info.requeue_id}.{info.restart_count}"


def write_end_time(path: Path, end_time: Optional[float]) -> None:
    """Write ``end_time`` (Unix s; ``None`` = unlimited: an empty file) atomically (temp + rename)."""
    write_atomic(path, "" if end_time is None else repr(end_time))


def remove_stale(run_dir: Path, keep: Path) -> None:
    """Delete end-time files of earlier job runs in ``run_dir`` (all but ``keep``)."""
    for p in Path(run_dir).glob(PREFIX + "*"):
        if p != keep:
            try:
                p.unlink()
            except OSError:
                pass


class JobEndTime:
    """The ranks' reader: :meth:`get` returns the current end time (Unix s) or ``None``.

    Args:
        environ: where the launcher's end time and end-time file are read
            (:meth:`LaunchEnv.from_environ <trainguard.launch_env.LaunchEnv.from_environ>`; default
            ``os.environ``, at construction).
    Raises:
        LaunchEnvError: the end time in ``environ`` is not a number.
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        launch = LaunchEnv.from_environ(environ)
        self.value = launch.end_time
        self.path = str(launch.end_time_file) if launch.end_time_file is not None else None
        self._mtime: Optional[int] = None

    def get(self) -> Optional[float]:
        """The end time from the file when it exists (re-read only after it changed), else the
        environment's."""
        if self.path is None:
            return self.value
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime != self._mtime:
                text = Path(self.path).read_text().strip()
                self._mtime = mtime
                self.value = _float(text)
        except OSError:
            pass
        return self.value


class EndTimeRefresher(threading.Thread):
    """A daemon thread in the first node's launcher: every ``interval`` seconds, re-read the job's
    EndTime; when it changed, rewrite the end-time file and emit ``slurm_end_time_changed``.

    Args:
        info: the job (its ``end_time`` is the value the ranks have now).
        path: the end-time file.
        margin: ``[slurm] end_margin`` seconds, subtracted from EndTime.
        interval: seconds between two ``scontrol show job`` calls.
        events: the launcher's event log.
    """

    def __init__(self, info: SLURMInfo, path: Path, margin: float, interval: float, events: EventLog):
        super().__init__(name="trainguard-end-time", daemon=True)
        self.info, self.path, self.margin, self.interval, self.events = info, path, margin, interval, events
        self.current = info.end_time
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                job = show_job(self.info.job_id)
            except SlurmError:
                continue  # slurmctld busy or down: keep the last known end time
            end = parse_slurm_timestamp(job.get("EndTime"))
            if end is None or end == self.current or self._stopped.is_set():
                continue
            self.current = end
            write_end_time(self.path, end - self.margin)
            try:
                limit = parse_slurm_time(job.get("TimeLimit", ""))
            except ValueError:
                limit = None
            self.events.emit("slurm_end_time_changed", end_time=end, time_limit=limit, ranks_end_time=end - self.margin)

    def stop(self) -> None:
        """Ask the thread to end (it exits within ``interval`` seconds; it is a daemon anyway)."""
        self._stopped.set()
