"""The processes of a launch, on record in its run directory, so that a relaunch never trains beside them.

Every launcher keeps ``RUN_DIR/.launches/<host>-<launcher pid>.json``: its own pid and start time,
its heartbeat directory, and the pid and start time of every rank it started (rewritten at each
start of a worker group). It removes the file when it ends. A file left behind means that its
launcher died without stopping its ranks (SIGKILL, the OOM killer). The ranks normally die with it
(:mod:`trainguard.launcher.deathsig`), but a process stuck in the kernel (D state: a hung network
filesystem or GPU driver call) does not die of SIGKILL until the call returns.

Before it starts anything, a launch checks the files its host left behind (:func:`check_previous`):
while a recorded process is alive (same pid, same start time, not a zombie) the launch is refused
with :class:`PreviousLaunchAlive`, naming the pids and the run dir; a file whose processes are all
gone is removed, with the dead launch's heartbeat directory. Files whose launcher is alive (the
agents of one multi-node job on one host) and files of other hosts (whose processes cannot be
seen from here) are left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

import psutil

from .. import console
from ..atomic import write_atomic
from .lock import RunDirLocked

DIRNAME = ".launches"
HB_PREFIX = "trainguard-hb-"  # a heartbeat directory's name starts so (only such are removed)
START_TOLERANCE = 1.0  # seconds: start times read by two processes may differ (boot time jitter)


class PreviousLaunchAlive(RunDirLocked):
    """Processes of an earlier launch in this run directory are still alive (the message names
    their pids and the run dir), or its record cannot be read."""


def start_time(pid: int) -> Optional[float]:
    """Start time of process ``pid`` (Unix s), or ``None`` when it is gone or a zombie."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def alive(pid: int, started: float) -> bool:
    """Whether the process ``pid`` that started at ``started`` (Unix s) still runs (a later
    process that reuses the pid does not count)."""
    now = start_time(pid)
    return now is not None and abs(now - started) <= START_TOLERANCE


class LaunchRecord:
    """This launcher's file in ``RUN_DIR/.launches``.

    Args:
        run_dir: the run directory.
        heartbeat_dir: the launch's heartbeat directory (removed by a later launch once this
            launch's processes are all gone), or ``None``.
    Raises:
        OSError: the record cannot be written (on :meth:`write_ranks`).
    """

    def __init__(self, run_dir: Path, heartbeat_dir: Optional[Path] = None):
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.path = Path(run_dir) / DIRNAME / f"{self.host}-{self.pid}.json"
        self.heartbeat_dir = heartbeat_dir
        self._started = start_time(self.pid) or time.time()
        self._ranks: dict[int, tuple[int, float]] = {}  # local rank → (pid, start time)

    def write_ranks(self, pids: dict[int, int]) -> None:
        """Record the ranks just started (``{local_rank: pid}``), replacing earlier ones."""
        started = {r: (pid, start_time(pid)) for r, pid in pids.items()}
        self._ranks = {r: (pid, t) for r, (pid, t) in started.items() if t is not None}
        record = {
            "host": self.host,
            "launcher": {"pid": self.pid, "started": self._started},
            "heartbeat_dir": str(self.heartbeat_dir) if self.heartbeat_dir else None,
            "ranks": {str(r): {"pid": pid, "started": t} for r, (pid, t) in self._ranks.items()},
        }
        try:
            self.path.parent.mkdir(exist_ok=True)
            write_atomic(self.path, json.dumps(record))
        except OSError as e:  # a full disk: the previous record stays (an older list of pids)
            console.warn(f"the launch record {self.path} could not be written: {e.strerror or e}")

    def close(self) -> list[int]:
        """At the launch's end: delete the record, unless a recorded rank is still alive (one in
        state D, say), whose record then makes later launches wait for it. Returns its live pids."""
        live = sorted(pid for pid, started in self._ranks.values() if alive(pid, started))
        if not live:
            self.path.unlink(missing_ok=True)
        return live


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
        ranks = {int(r): (int(p["pid"]), float(p["started"])) for r, p in record["ranks"].items()}
        launcher = (int(record["launcher"]["pid"]), float(record["launcher"]["started"]))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise PreviousLaunchAlive(
            f"cannot read the launch record {path} ({type(e).__name__}: {e}); if no process of that launch "
            f"is alive, delete the file and launch again"
        ) from None
    return {"launcher": launcher, "ranks": ranks, "heartbeat_dir": record.get("heartbeat_dir")}


def _remove_heartbeat_dir(value: Optional[str]) -> None:
    if value and Path(value).name.startswith(HB_PREFIX):
        shutil.rmtree(value, ignore_errors=True)


def check_previous(run_dir: Path) -> None:
    """Refuse to launch while processes of an earlier launch of this host in ``run_dir`` live;
    remove the records (and heartbeat directories) of earlier launches that are all gone.

    Raises:
        PreviousLaunchAlive: a recorded rank of a dead launcher is alive (the message names the pids,
            the dead launcher and the run dir), or a record of this host cannot be read.
    """
    host = socket.gethostname()
    for path in sorted((Path(run_dir) / DIRNAME).glob(f"{host}-*.json")):
        record = _read(path)
        if not record or alive(*record["launcher"]):
            continue  # gone meanwhile, or an agent of this job that runs now
        live = sorted(pid for pid, started in record["ranks"].values() if alive(pid, started))
        if live:
            pids = ", ".join(map(str, live))
            raise PreviousLaunchAlive(
                f"run dir {run_dir}: processes of a previous launch are still alive: pids {pids} (ranks of "
                f"launcher pid {record['launcher'][0]}, which has ended); a new launch would train beside them "
                f"in the same run directory. Wait for them to exit or stop them (kill -9 {' '.join(map(str, live))}; "
                f"a process in state D only dies once its kernel call returns), then launch again"
            )
        _remove_heartbeat_dir(record["heartbeat_dir"])
        path.unlink(missing_ok=True)


__all__ = ["LaunchRecord", "PreviousLaunchAlive", "alive", "check_previous", "start_time"]
