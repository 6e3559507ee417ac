"""One launch per run directory: an advisory ``flock`` on ``RUN_DIR/.launch.lock`` held for the
launcher's lifetime.

A single-node launch holds it exclusively. The agents of one multi-node job share it: the first
one takes it exclusively, writes its job id (the rendezvous id) and downgrades to a shared lock; the
others take it shared after checking that the id is theirs. A launch of another job is refused
either way. The kernel releases the lock when the process exits, however it exits (even SIGKILL),
so a stale lock file never blocks a relaunch.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional


class RunDirLocked(RuntimeError):
    """Another launch holds the run directory's lock (the message names its pid and host)."""


class RunDirLock:
    """Context manager holding the run directory's lock.

    Args:
        path: the lock file.
        job_id: ``None`` for a single-node launch (exclusive); the rendezvous id for the agents of a
            multi-node job (shared among agents with the same id).
        wait: seconds to retry while another agent of the same job is between taking and sharing it.
        what: the directory's name in messages (the same lock guards a checkpoint directory outside
            the run directory: two runs must not share one, they would delete each other's files).
    Raises:
        RunDirLocked: on enter, when another launch holds it.
    """

    def __init__(self, path: Path, job_id: Optional[str] = None, wait: float = 5.0, what: str = "run dir"):
        self.path = Path(path)
        self.job_id = job_id
        self.wait = wait
        self.what = what  # the directory's name in messages ("run dir", "checkpoint dir")
        self._fd: Optional[int] = None

    def __enter__(self) -> RunDirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + (self.wait if self.job_id else 0)
        while True:
            if self._try(fd, fcntl.LOCK_EX):
                os.ftruncate(fd, 0)
                info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "job": self.job_id}
                os.pwrite(fd, json.dumps(info).encode(), 0)
                if self.job_id and not self._try(fd, fcntl.LOCK_SH):  # let the other agents of this job in
                    os.close(fd)  # (the conversion is not atomic: another launch took it meanwhile)
                    raise RunDirLocked(f"{self.what} {self.path.parent} was taken by another launch while locking it")
                self._fd = fd
                return self
            holder = self._holder(fd)
            if self.job_id and holder.get("job") == self.job_id and self._try(fd, fcntl.LOCK_SH):
                if self._holder(fd).get("job") == self.job_id:
                    self._fd = fd
                    return self
                fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() >= deadline:
                os.close(fd)
                shown = {k: holder[k] for k in ("pid", "host", "job") if holder.get(k) is not None} or "unknown"
                raise RunDirLocked(
                    f"{self.what} {self.path.parent} is in use by another launch ({shown}); "
                    f"wait for it to end or choose another {'--run-dir' if self.what == 'run dir' else self.what} "
                    f"(lock file {self.path})"
                )
            time.sleep(0.05)

    @staticmethod
    def _try(fd: int, mode: int) -> bool:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode(errors="replace") or "{}")
        except json.JSONDecodeError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
