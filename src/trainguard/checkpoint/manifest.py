"""Checkpoint manifests: every file of a checkpoint with its size and checksum.

``manifest.json`` is the last file written into a checkpoint directory before the atomic rename,
so a directory with a manifest that verifies is complete. Checksums are XXH3-128 (the ``xxhash``
package): a non-cryptographic hash that runs at memory speed, so verifying costs little next to the
disk write; it detects torn writes, truncation and bit flips, not tampering.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import xxhash

from ..atomic import fsync_path  # noqa: F401  (mf.fsync_path: one copy, in trainguard.atomic)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 8 << 20


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
    """Write ``root/manifest.json`` (fsynced) listing ``files``; ``meta`` is stored as is."""
    body = {"format": FORMAT_VERSION, "step": step, "files": files, "meta": meta}
    with open(root / MANIFEST, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: Path) -> dict:
    """Parse ``root/manifest.json``.

    Raises:
        FileNotFoundError: no manifest; ValueError: not a valid manifest.
    """
    with open(root / MANIFEST) as f:
        body = json.load(f)
    if not isinstance(body, dict) or "files" not in body or "step" not in body:
        raise ValueError("manifest.json lacks 'files' or 'step'")
    return body


def verify(root: Path, mode: str = "full") -> Optional[str]:
    """Check a checkpoint directory against its manifest.

    Args:
        root: the checkpoint directory.
        mode: ``"full"`` compares sizes and checksums, ``"size"`` only sizes.
    Returns:
        ``None`` when it verifies, else the first reason it does not (a short sentence).
    """
    try:
        body = read_manifest(root)
    except FileNotFoundError:
        return "manifest.json is missing"
    except (ValueError, OSError) as e:
        return f"manifest.json is unreadable: {e}"
    for name, info in sorted(body["files"].items()):
        p = root / name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != info["size"]:
            return f"{name} has {size} bytes, manifest says {info['size']}"
        if mode == "full" and hash_file(p) != info["xxh3_128"]:
            return f"{name} checksum mismatch"
    return None
