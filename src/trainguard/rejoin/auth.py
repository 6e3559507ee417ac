"""Authenticated values in the recovery store: a per-launch secret and an HMAC on every value.

Across nodes the recovery store is a ``TCPStore`` on the rendezvous interface
(:func:`~.protocol.serve`): anyone who can reach its port can read and write any key. On one node
it is a file only the launching user can open (:mod:`.stores`). Either way every value the
launcher and the ranks write there is sealed with HMAC-SHA256 under a secret that never travels
through a store:

* the secret is 32 random bytes in ``RUN_DIR/.recovery-key`` (mode 0600, created by the first
  launcher that starts, read by the others: the run directory is shared by the nodes, as the
  event log is; nodes with run directories of their own get different keys, refuse each other's
  values and restart the group instead of recovering in-process); the launcher hands it to its ranks and spares in their environment
  (``TRAINGUARD_RECOVERY_KEY``), which only the same user (and root) can read;
* a *nonce* per launch: 16 random bytes each launcher draws when it starts (:func:`new_nonce`),
  handed to its ranks and spares like the key (``TRAINGUARD_RECOVERY_NONCE``; the values of the
  shared recovery store are bound to the nonce of the launcher that serves it, which the other
  nodes take from its sealed offer, :mod:`trainguard.launcher.node_join`);
* a sealed value is ``NONCE_HEX ":" HEX(HMAC(secret, nonce + key name + NUL + value)) ":" value``
  (:class:`Seal`): the MAC covers the launch's nonce and the full key name (with its group start
  prefix), so a value cannot be replayed into another launch (the key names, ``attempt1/gen/1``,
  ``spares/1``, repeat from launch to launch, and the key file is reused), under another key or
  into another start of the group.

A value whose seal does not verify is treated as absent, and the reader's ``on_forged`` callback
is told (a ``security`` event, :func:`report_forged`). What is not covered: the store's atomic
counters (``add``: a forged increment only skips generation numbers, which makes a recovery time
out into a group restart) and torch's own per-round keys in its rendezvous store (the rendezvous
state itself is sealed with this module's :class:`Seal`: :mod:`trainguard.launcher.sealed_rdzv`).
Reads go through :func:`read_now`, which never waits for a key.
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


NONCE_BYTES = 16  # a launch's nonce: 128 random bits, never drawn twice in practice


def new_nonce() -> bytes:
    """A fresh per-launch nonce (:data:`NONCE_BYTES` random bytes)."""
    return secrets.token_bytes(NONCE_BYTES)


class Seal:
    """Seals and opens values under one key and one launch's nonce.

    A sealed value is ``NONCE_HEX ":" HEX(HMAC(key, len(nonce) + nonce + name + NUL + value)) ":" value``:
    the MAC binds the launch's nonce and the full key name, so a value recorded in another launch
    (another nonce; the key names repeat from launch to launch: ``attempt1/gen/1``, ``spares/1``)
    or under another key does not open. The nonce travels in the clear so that a refusal can say
    whether it was a replay (:meth:`why`); it is no secret, the key is.

    Args:
        key: the launch's secret (:func:`launch_key`), :data:`KEY_BYTES` bytes.
        nonce: the launch's nonce (:func:`new_nonce`; ``b""``: values bound to no launch, for what
            binds its freshness in the key name instead, :mod:`trainguard.launcher.node_join`).
    Raises:
        ValueError: ``key`` is shorter than 16 bytes.
    """

    SEPARATOR = b":"

    def __init__(self, key: bytes, nonce: bytes = b""):
        if len(key) < 16:
            raise ValueError(f"a recovery store key needs at least 16 bytes, got {len(key)}")
        self.key, self.nonce = key, nonce

    def under(self, nonce: bytes) -> Seal:
        """A seal with the same key and another nonce."""
        return Seal(self.key, nonce)

    def _mac(self, nonce: bytes, name: str, value: bytes) -> bytes:
        message = bytes([len(nonce)]) + nonce + name.encode() + b"\0" + value  # the nonce length-prefixed
        return hmac.new(self.key, message, hashlib.sha256).hexdigest().encode()

    def seal(self, name: str, value: str | bytes) -> bytes:
        """``value`` sealed for the key ``name`` (the full key, prefix included) in this launch."""
        raw = value.encode() if isinstance(value, str) else value
        return self.nonce.hex().encode() + self.SEPARATOR + self._mac(self.nonce, name, raw) + self.SEPARATOR + raw

    def _parts(self, blob: bytes) -> Optional[tuple[bytes, bytes, bytes]]:
        """(nonce, MAC, value) of a sealed blob, ``None`` when it is not of that form."""
        nonce_hex, sep1, rest = blob.partition(self.SEPARATOR)
        mac, sep2, raw = rest.partition(self.SEPARATOR)
        try:
            nonce = bytes.fromhex(nonce_hex.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        return (nonce, mac, raw) if sep1 and sep2 else None

    def open(self, name: str, blob: bytes) -> Optional[bytes]:
        """The value of a sealed ``blob`` read from key ``name``, or ``None`` when its seal does
        not verify (forged, written under another key or in another launch, or not sealed)."""
        parts = self._parts(blob)
        if parts is None or parts[0] != self.nonce:
            return None
        _, mac, raw = parts
        return raw if hmac.compare_digest(mac, self._mac(self.nonce, name, raw)) else None

    def why(self, name: str, blob: bytes) -> str:
        """Why :meth:`open` refuses ``blob`` (for the ``security`` event): ``"replayed"`` (sealed
        with this key under another launch's nonce: recorded in an earlier launch), ``"forged"``
        (not sealed with this key for ``name``), ``""`` when it opens."""
        if self.open(name, blob) is not None:
            return ""
        parts = self._parts(blob)
        if parts is not None and hmac.compare_digest(parts[1], self._mac(parts[0], name, parts[2])):
            return "replayed"
        return "forged"


WHAT = {
    "replayed": "a value sealed in another launch (a replay) was refused",
    "forged": "a value without this launch's seal was refused",
    "": "a value without this launch's seal (forged, or replayed from another launch) was refused",
}


PROBE = "trainguard:probe"  # compare_set(key, PROBE, PROBE): the key's value without waiting for it
MAX_VALUE_BYTES = 64 << 20  # a store value above this is refused before its seal is computed


class StoreReadError(RuntimeError):
    """A store could not be read (the message names the key and the store's error)."""


def read_now(store, name: str) -> Optional[bytes]:
    """The value of key ``name`` in ``store`` (a c10d ``Store``), ``None`` when it is absent, in
    one round trip that never waits for the key: ``compare_set`` of a probe value, which answers
    the stored value, or the probe when there is none (a ``check`` then ``get`` waits out the
    store's timeout when another client deletes the key between the two).

    Raises:
        StoreReadError: the store failed (connection lost, its timeout).
    """
    try:
        raw = store.compare_set(name, PROBE, PROBE)
    except (RuntimeError, ValueError, TimeoutError, OSError) as e:
        raise StoreReadError(f"reading {name}: {type(e).__name__}: {e}") from e
    return None if raw == PROBE.encode() else raw


def report_forged(events, key: str, why: str = "") -> None:
    """Tell of a refused value: a ``security`` event (``events``: an
    :class:`~trainguard.events.EventLog`; fields ``key``, ``what`` and ``why``: ``forged`` or
    ``replayed`` where the reader told them apart (:meth:`Seal.why`), else ``unverified``) and a
    console warning."""
    from .. import console

    events.emit("security", key=key, what=WHAT.get(why, WHAT[""]), why=why or "unverified")
    console.warn(
        f"refused a value in the recovery store (key {key}): {WHAT.get(why, WHAT[''])}; "
        "a process without this launch's key and nonce wrote it"
    )


def reporter(events):
    """A ``on_forged`` callback that tells of each refused key once (:func:`report_forged`): the
    readers that poll a key would otherwise tell of the same value at every look."""
    told: set[str] = set()

    def tell(key: str, why: str = "") -> None:
        if key not in told:
            told.add(key)
            report_forged(events, key, why)

    return tell
