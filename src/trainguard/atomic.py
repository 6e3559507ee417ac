"""Atomic small-file writes: the whole new content or the old one, never a torn file."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Replace ``path`` with ``data``: write a temporary file beside it (``.NAME.tmp-PID``), fsync
    it, then ``os.replace`` it over ``path`` (atomic on POSIX). A crash leaves the old file or the
    new one; a stale temporary file at most. Returns ``path``.

    Raises:
        OSError: the directory is not writable (the temporary file is removed).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return path
