"""Checkpoint manifests: every file of a checkpoint with its size and checksum.

``manifest.json`` is the last file written into a checkpoint directory before the atomic rename,
so a directory with a manifest that verifies is complete. Checksums are XXH3-128 (the ``xxhash``
package): a non-cryptographic hash that runs at memory speed, so verifying costs little next to the
disk write; it detects torn writes, truncation and bit flips, not tampering.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import xxhash

from ..atomic import fsync_path  # noqa: F401  (mf.fsync_path: one copy, in trainguard.atomic)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 8 << 20
T = TypeVar("T")


def hash_file(path: str | os.PathLike) -> str:
    """XXH3-128 hex digest of a file's bytes, read in 8 MiB chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"size": bytes, "xxh3_128": hex}}`` for the given files under ``root``."""
    return {n: {"size": (root / n).stat().st_size, "xxh3_128": hash_file(root / n)} for n in names}


def write_manifest(root: Path, step: int, files: dict[str, dict], meta: dict) -> None:
    """Write ``root/manifest.json`` (fsynced, mode 0600) listing ``files``; ``meta`` is stored as is."""
    body = {"format": FORMAT_VERSION, "step": step, "files": files, "meta": meta}
    (root / MANIFEST).unlink(missing_ok=True)
    with open(os.open(root / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


class ReadError(OSError):
    """A checkpoint could not be read for a reason that may pass (an I/O error, a stale handle of a
    shared file system): after :data:`READ_TRIES` tries it is neither valid nor invalid. Callers
    must not set it aside or fall back to an older checkpoint on it (the launcher's restart tries
    again later)."""


# errno values of a read that may succeed when tried again (a shared file system's hiccup)
TRANSIENT = {errno.EIO, errno.ESTALE, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ENOTCONN, errno.EBUSY}
READ_TRIES = 3  # reads of a manifest or a file before a transient error counts (waits 0.2 s, 1 s between)
_WAITS = (0.2, 1.0)


def _retried(read: Callable[[], T], what: str) -> T:
    """``read()``, tried again on a transient error (:data:`TRANSIENT`).

    Raises:
        ReadError: still failing after :data:`READ_TRIES` tries (names ``what``).
        OSError: a lasting error (a missing file: ``FileNotFoundError``).
    """
    for attempt in range(READ_TRIES):
        try:
            return read()
        except OSError as e:
            if e.errno not in TRANSIENT:
                raise
            if attempt == READ_TRIES - 1:
                raise ReadError(e.errno, f"{what}: {e.strerror or e} ({READ_TRIES} tries)") from e
            time.sleep(_WAITS[attempt])
    raise AssertionError("unreachable")


def _valid_body(body: Any) -> Optional[str]:
    """Why ``body`` is not a manifest of this format (``None`` if it is)."""
    if not isinstance(body, dict) or "files" not in body or "step" not in body:
        return "manifest.json lacks 'files' or 'step'"
    if not isinstance(body["step"], int) or isinstance(body["step"], bool):
        return f"manifest.json: 'step' is {body['step']!r}, expected a step number"
    files = body["files"]
    if not isinstance(files, dict):
        return f"manifest.json: 'files' is {type(files).__name__}, expected a table of files"
    for name, info in files.items():
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("size"), int)
            or not isinstance(info.get("xxh3_128"), str)
        ):
            return f"manifest.json: the entry of {name!r} is not {{size, xxh3_128}}"
    return None


def read_manifest(root: Path) -> dict:
    """Parse ``root/manifest.json`` (a transient read error is tried again).

    Raises:
        FileNotFoundError: no manifest. ValueError: not a valid manifest (not JSON, or JSON of
            another shape). ReadError: it could not be read in :data:`READ_TRIES` tries.
    """

    def read() -> Any:
        with open(root / MANIFEST) as f:
            return json.load(f)

    body = _retried(read, f"reading {root / MANIFEST}")
    problem = _valid_body(body)
    if problem is not None:
        raise ValueError(problem)
    return body


def verify(root: Path, mode: str = "full") -> Optional[str]:
    """Check a checkpoint directory against its manifest.

    Args:
        root: the checkpoint directory.
        mode: ``"full"`` compares sizes and checksums, ``"size"`` only sizes.
    Returns:
        ``None`` when it verifies, else the first reason it does not (a short sentence).
    Raises:
        ReadError: the manifest or a file could not be read in :data:`READ_TRIES` tries: neither
            valid nor invalid.
    """
    try:
        body = read_manifest(root)
    except FileNotFoundError:
        return "manifest.json is missing"
    except ValueError as e:
        return f"manifest.json is unreadable: {e}"
    except ReadError:
        raise
    except OSError as e:  # a lasting error (a directory where the file should be, ...)
        return f"manifest.json is unreadable: {e}"
    for name, info in sorted(body["files"].items()):
        p = root / name
        try:
            size = _retried(lambda p=p: p.stat().st_size, f"reading {p}")
        except FileNotFoundError:
            return f"{name} is missing"
        if size != info["size"]:
            return f"{name} has {size} bytes, manifest says {info['size']}"
        if mode == "full" and _retried(lambda p=p: hash_file(p), f"reading {p}") != info["xxh3_128"]:
            return f"{name} checksum mismatch"
    return None
