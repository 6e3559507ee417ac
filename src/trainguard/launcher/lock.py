"""One launch per run directory: an advisory ``flock`` held for the launcher's lifetime.

The lock is released by the kernel when the launcher exits, however it exits (even SIGKILL), so a
stale lock file never blocks a relaunch.
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
    """Context manager holding an exclusive ``flock`` on ``path``.

    Raises:
        RunDirLocked: on enter, when another process holds it.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: Optional[int] = None

    def __enter__(self) -> "RunDirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirLocked(
                f"run dir {self.path.parent} is in use by another launch ({holder}); "
                f"wait for it to end or choose another --run-dir (lock file {self.path})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
