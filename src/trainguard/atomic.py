"""Atomic, durable small-file writes: the whole new content or the old one, never a torn file.

The one routine for every small file trainguard replaces in place (run id, SLURM end time,
``FINISHED``, watch state, ``timeouts.json``, ``config.toml``, the rollback ledger, a checkpoint's
``manifest.json`` when it is marked known-good). The protocol is the usual POSIX one: write a
temporary file on the same filesystem, ``fsync`` it, ``rename(2)`` it over the target (atomic),
then ``fsync`` the directory so that the rename itself survives a power loss.

Every file is written with mode 0600 (owner only): these files sit in the run directory or a
checkpoint directory, which are private too (:mod:`trainguard.rundir`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory fsync makes its entries, e.g. a rename, durable).

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: str | bytes, tmp: Optional[str | os.PathLike] = None) -> Path:
    """Replace ``path`` with ``data`` (text is UTF-8 encoded), atomically and durably.

    Writes the temporary file ``tmp`` (default ``.NAME.tmp-PID`` beside ``path``) and fsyncs it,
    ``os.replace``\\s it over ``path`` (mode 0600), then fsyncs ``path``'s directory (and ``tmp``'s, when it
    is another one: the rename removed an entry there). A crash leaves the old file or the new one,
    and a stale temporary file at most.

    Args:
        path: the file to replace (created if absent).
        data: its whole new content.
        tmp: where to write the temporary file; it must be on ``path``'s filesystem. A checkpoint's
            manifest uses a ``.tmp-`` name in the store root, so that the checkpoint directory
            never holds a file its manifest does not list.
    Returns:
        ``path``.
    Raises:
        OSError: the temporary file cannot be written or renamed (it is removed), or a directory
            cannot be synced (the new content is then in place, its durability unknown).
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a stale one may have another mode
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    if tmp.parent.resolve() != path.parent.resolve():
        fsync_path(tmp.parent)
    return path
