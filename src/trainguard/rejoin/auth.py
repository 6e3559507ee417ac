"""Authenticated values in the recovery store: a per-launch secret and an HMAC on every value.

The recovery store is a ``TCPStore``: anyone who can reach its port can read and write any key.
It listens on loopback when all ranks are on one node, on the rendezvous interface across nodes
(:func:`~.protocol.serve`), and every value the launcher and the ranks write there is sealed with
HMAC-SHA256 under a secret that never travels through a store:

* the secret is 32 random bytes in ``RUN_DIR/.recovery-key`` (mode 0600, created by the first
  launcher that starts, read by the others: the run directory is shared by the nodes, as the
  event log is; nodes with run directories of their own get different keys, refuse each other's
  values and restart the group instead of recovering in-process); the launcher hands it to its ranks and spares in their environment
  (``TRAINGUARD_RECOVERY_KEY``), which only the same user (and root) can read;
* a sealed value is ``HEX(HMAC(secret, key name + NUL + value)) ":" value``: the MAC covers the
  full key name (with its group start prefix), so a value cannot be replayed under another key
  or into another start of the group.

A value whose seal does not verify is treated as absent, and the reader's ``on_forged`` callback
is told (a ``security`` event). What is not covered: the store's atomic counters (``add``: a
forged increment only skips generation numbers, which makes a recovery time out into a group
restart) and torch's own rendezvous store.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Optional

KEY_FILE = ".recovery-key"
KEY_BYTES = 32  # HMAC-SHA256's block-size-independent recommendation: a key as long as the hash


class KeyFileError(ValueError):
    """``RUN_DIR/.recovery-key`` is not a key this module wrote (the message names the file)."""


def launch_key(run_dir: Path) -> bytes:
    """The launch's secret: read ``run_dir/.recovery-key``, or create it (32 random bytes, hex,
    mode 0600) when absent. Creation is atomic (a temporary file hard-linked into place): two
    launchers that start together end with the same key, and no reader sees a partial file.

    Raises:
        KeyFileError: the file exists but does not hold a hex key of :data:`KEY_BYTES` bytes, or
            is readable by others than its owner (mode other than 0600).
        OSError: the run directory cannot be written.
    """
    path = Path(run_dir) / KEY_FILE
    if not path.exists():
        tmp = path.with_name(f"{KEY_FILE}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(KEY_BYTES).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another launcher was first: its key wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return read_key(path)


def read_key(path: Path) -> bytes:
    """The key in ``path`` (see :func:`launch_key`).

    Raises:
        KeyFileError: not a private file holding :data:`KEY_BYTES` bytes as hex.
    """
    if path.stat().st_mode & 0o077:
        raise KeyFileError(f"{path}: the recovery key must be readable by its owner only (chmod 600 {path})")
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"{path}: expected {KEY_BYTES} bytes as hex; delete the file to make a new key")
    return key


class Seal:
    """Seals and opens values under one key.

    Args:
        key: the launch's secret (:func:`launch_key`), :data:`KEY_BYTES` bytes.
    Raises:
        ValueError: ``key`` is shorter than 16 bytes.
    """

    SEPARATOR = b":"

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError(f"a recovery store key needs at least 16 bytes, got {len(key)}")
        self.key = key

    def _mac(self, name: str, value: bytes) -> bytes:
        return hmac.new(self.key, name.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()

    def seal(self, name: str, value: str | bytes) -> bytes:
        """``value`` sealed for the key ``name`` (the full key, prefix included)."""
        raw = value.encode() if isinstance(value, str) else value
        return self._mac(name, raw) + self.SEPARATOR + raw

    def open(self, name: str, blob: bytes) -> Optional[bytes]:
        """The value of a sealed ``blob`` read from key ``name``, or ``None`` when its seal does
        not verify (forged, written under another key, or not sealed at all)."""
        mac, sep, raw = blob.partition(self.SEPARATOR)
        if not sep or not hmac.compare_digest(mac, self._mac(name, raw)):
            return None
        return raw


def report_forged(events, key: str) -> None:
    """Tell of a refused value: a ``security`` event (``events``: an
    :class:`~trainguard.events.EventLog`) and a console warning."""
    from .. import console

    events.emit("security", key=key, what="a value without this launch's seal was refused")
    console.warn(
        f"refused a forged value in the recovery store (key {key}): a process without the launch's key wrote it"
    )
