"""torch's dynamic rendezvous, its state sealed and carried as JSON: no pickle through a store.

torch's ``c10d`` rendezvous backend keeps the rendezvous state (who takes part, the round, the
nodes' heartbeats) as a base64 *pickle* under ``torch.rendezvous.RUN_ID`` in the rendezvous store,
and its ``DynamicRendezvousHandler`` unpickles whatever it reads there about once a second: any
process that can reach the store (every local user, on loopback) could run code as the user who
launched the job. :class:`SealedBackend` is a backend of torch's interface
(``RendezvousBackend``: ``get_state``/``set_state`` of bytes and a fencing token) that keeps the
state under ``trainguard/rendezvous/RUN_ID`` instead:

* as JSON of the state's fields (:func:`encode_state`), never a pickle;
* sealed (:class:`~trainguard.rejoin.auth.Seal`, HMAC-SHA256 under the run's
  ``.recovery-key`` and, on one node, the launch's nonce) with a count of writes (``seq``) inside
  the seal, and verified *before* it is decoded;
* read without blocking (``compare_set`` of a probe value: a deleted key is seen at once, not
  after the store's timeout) and refused above :data:`MAX_STATE_BYTES` before anything else.

torch's handler still pickles: it hands :meth:`SealedBackend.set_state` the ``pickle.dumps`` of its
own state and unpickles what the backend returns. What the backend returns is always the pickle of
a state it built itself from verified fields (:func:`decode_state`), or the bytes torch just gave
it: nothing read from a store reaches ``pickle.loads``. The bytes torch gives are read back with
an unpickler that builds torch's two state classes, ``datetime`` and the built-in containers only.

A value that does not verify (forged, replayed from an earlier write or launch, corrupt, too
large) or a deleted key is a ``security`` event (``key``, ``what``, ``why``) and is treated as
the last state this backend verified (none yet: an empty one), with a token that lets the next
write replace it: the rendezvous goes on, and heals the store at its next write (a heartbeat,
every ``keep_alive_interval`` s).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from datetime import datetime
from typing import Any, Callable, Optional

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from ..compat import DYNAMIC_RDZV, RENDEZVOUS_FIELDS, rendezvous_classes
from ..rejoin.auth import Seal, StoreReadError, read_now

KEY = "trainguard/rendezvous/{}"  # + run id
MAX_STATE_BYTES = 1 << 20  # a sealed state above this is refused unread (1,000 nodes: ~200 KB)
MAX_NODES = 4096  # entries per list of the state
MAX_ADDR = 255  # characters of a node's address (a host name's limit)
MAX_TOLD = 20  # security events per backend; later refusals are counted in the last one

Token = Optional[bytes]


class StateFormatError(ValueError):
    """A verified rendezvous state whose fields are not what :func:`encode_state` writes (the
    message names the field)."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise StateFormatError(what)


def _node_fields(node: Any) -> list:
    return [node.addr, node.pid, node.local_id]


def encode_state(state: Any, seq: int) -> bytes:
    """``state`` (torch's ``_RendezvousState``) and the write count ``seq`` as JSON bytes (nodes
    as ``[addr, pid, local_id]``, times as ISO 8601 with their zone)."""
    return json.dumps(
        {
            "seq": seq,
            "round": state.round,
            "complete": state.complete,
            "deadline": state.deadline.isoformat() if state.deadline is not None else None,
            "closed": state.closed,
            "participants": [_node_fields(n) + [r] for n, r in state.participants.items()],
            "wait_list": sorted(_node_fields(n) for n in state.wait_list),
            "redundancy_list": sorted(_node_fields(n) for n in state.redundancy_list),
            "last_heartbeats": [_node_fields(n) + [t.isoformat()] for n, t in state.last_heartbeats.items()],
        },
        separators=(",", ":"),
    ).encode()


def _int(v: Any, what: str, low: int = 0, high: int = 1 << 62) -> int:
    _check(type(v) is int and low <= v <= high, f"{what}: expected an integer in [{low}, {high}], got {v!r:.40}")
    return v


def _time(v: Any, what: str) -> datetime:
    _check(isinstance(v, str) and len(v) <= 40, f"{what}: expected an ISO 8601 time")
    try:
        t = datetime.fromisoformat(v)
    except ValueError:
        raise StateFormatError(f"{what}: not an ISO 8601 time: {v!r:.40}") from None
    _check(t.tzinfo is not None, f"{what}: a time without its zone")
    return t


def _nodes(v: Any, what: str, extra: int) -> list[tuple]:
    _check(isinstance(v, list) and len(v) <= MAX_NODES, f"{what}: expected a list of at most {MAX_NODES} nodes")
    out = []
    for item in v:
        _check(isinstance(item, list) and len(item) == 3 + extra, f"{what}: expected [addr, pid, local_id, ...]")
        addr, pid, local_id = item[:3]
        _check(
            isinstance(addr, str) and 0 < len(addr) <= MAX_ADDR, f"{what}: a node address of 1-{MAX_ADDR} characters"
        )
        out.append((addr, _int(pid, f"{what}: pid", 0, 1 << 32), _int(local_id, f"{what}: local id"), *item[3:]))
    return out


def decode_state(raw: bytes) -> tuple[Any, int]:
    """The ``(_RendezvousState, seq)`` of JSON written by :func:`encode_state`; every field checked
    by type and size.

    Raises:
        StateFormatError: not such JSON (the message names the field).
        Incompatible: torch's state classes changed (:func:`~trainguard.compat.rendezvous_classes`).
    """
    state_cls, node_cls = rendezvous_classes()
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise StateFormatError(f"not JSON: {e}") from None
    _check(isinstance(d, dict) and set(d) == {"seq", *RENDEZVOUS_FIELDS}, "expected the state's fields and seq")
    state = state_cls()
    seq = _int(d["seq"], "seq")
    state.round = _int(d["round"], "round")
    for flag in ("complete", "closed"):
        _check(type(d[flag]) is bool, f"{flag}: expected true or false")
        setattr(state, flag, d[flag])
    state.deadline = None if d["deadline"] is None else _time(d["deadline"], "deadline")
    state.participants = {
        node_cls(a, p, i): _int(r, "participants: rank", 0, MAX_NODES)
        for a, p, i, r in _nodes(d["participants"], "participants", 1)
    }
    state.wait_list = {node_cls(*n) for n in _nodes(d["wait_list"], "wait_list", 0)}
    state.redundancy_list = {node_cls(*n) for n in _nodes(d["redundancy_list"], "redundancy_list", 0)}
    state.last_heartbeats = {
        node_cls(a, p, i): _time(t, "last_heartbeats")
        for a, p, i, t in _nodes(d["last_heartbeats"], "last_heartbeats", 1)
    }
    return state, seq


class _OwnPickle(pickle.Unpickler):
    """Reads the pickle torch's handler makes of its own state: its two classes, ``datetime``
    and ``timezone``; anything else is refused."""

    ALLOWED = {
        (DYNAMIC_RDZV, "_RendezvousState"),
        (DYNAMIC_RDZV, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
        ("builtins", "set"),
    }

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 (pickle's hook)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a rendezvous state holds no {module}.{name}")


def _from_torch(bits: bytes) -> Any:
    """torch's handler's pickle of its own state (:meth:`SealedBackend.set_state`), read back."""
    return _OwnPickle(io.BytesIO(bits)).load()


class SealedBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` over a c10d ``store``, the state sealed JSON (see the
    module's doc).

    Args:
        store: the rendezvous store (a ``TCPStore`` or ``FileStore``).
        run_id: the rendezvous id (in the key name, and so under the seal).
        seal: the run's key and, where one launcher is the whole rendezvous, its nonce.
        on_refused: told ``(key, why, detail)`` of each refused value (``why``: ``forged``,
            ``replayed``, ``corrupt``, ``oversize``, ``deleted``); at most :data:`MAX_TOLD` times
            (then once more, ``why`` ``"more"``).
    Raises:
        ValueError: an empty ``run_id``.
        Incompatible: torch's state classes changed (checked here, before any rendezvous).
    """

    def __init__(self, store: Any, run_id: str, seal: Seal, on_refused: Callable[[str, str, str], None]):
        if not run_id:
            raise ValueError("the rendezvous id must not be empty")
        rendezvous_classes()
        self.store, self.seal, self.key = store, seal, KEY.format(run_id)
        self.on_refused = on_refused  # each distinct refused value once, MAX_TOLD at most
        self.told = 0
        self.refused = b""  # the digest of the last value refused (each distinct value is told once)
        self.seq = 0  # the highest write count verified or written here: a lower one is a replay
        self.last: Optional[Any] = None  # the last state verified or written here

    @property
    def name(self) -> str:
        """torch's name of the backend kind (what ``get_backend`` reports)."""
        return "c10d"

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self.store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError, OSError) as e:
            raise RendezvousConnectionError(f"the rendezvous store failed ({op}): {type(e).__name__}: {e}") from e

    def _refuse(self, why: str, detail: str, raw: bytes) -> None:
        seen = hashlib.sha256(raw).digest()
        if seen == self.refused:
            return  # the same value read again (torch reads about once a second): told already
        self.refused = seen
        self.told += 1
        if self.told <= MAX_TOLD:
            self.on_refused(self.key, why, detail)
        elif self.told == MAX_TOLD + 1:
            self.on_refused(self.key, "more", f"further refused values of {self.key} are not told")

    def _sealed(self, state: Any) -> bytes:
        return self.seal.seal(self.key, encode_state(state, self.seq + 1))

    def _fallback(self, token: bytes) -> tuple[bytes, bytes]:
        """The last state verified here (or an empty one) with ``token``: what a refused value reads as."""
        state_cls, _ = rendezvous_classes()
        return pickle.dumps(self.last if self.last is not None else state_cls()), token

    def _open(self, raw: bytes, missing_ok: bool) -> Optional[tuple[bytes, bytes]]:
        """The ``(pickle of the state, token)`` of the stored ``raw`` (``b""``: the key is absent);
        ``None`` when absent and nothing was verified yet (``missing_ok``)."""
        if raw == b"":
            if self.last is None and missing_ok:
                return None
            self._refuse("deleted", "the rendezvous state was deleted from the store", raw)
            return self._fallback(b"")
        if len(raw) > MAX_STATE_BYTES:
            self._refuse("oversize", f"{len(raw)} bytes, more than {MAX_STATE_BYTES}", raw)
            return self._fallback(raw)
        body = self.seal.open(self.key, raw)
        if body is None:
            self._refuse(self.seal.why(self.key, raw) or "forged", "its seal does not verify", raw)
            return self._fallback(raw)
        try:
            state, seq = decode_state(body)
        except StateFormatError as e:
            self._refuse("corrupt", str(e), raw)
            return self._fallback(raw)
        if seq < self.seq:
            self._refuse("replayed", f"write {seq} after write {self.seq} was seen", raw)
            return self._fallback(raw)
        self.seq, self.last, self.refused = seq, state, b""
        return pickle.dumps(state), raw

    def _read(self) -> bytes:
        try:
            raw = read_now(self.store, self.key)
        except StoreReadError as e:
            raise RendezvousConnectionError(f"the rendezvous store failed: {e}") from e
        return b"" if raw is None else raw

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        """The state (torch's pickle of a state built here) and its token; ``None`` when there is
        none yet. Never waits for the key.

        Raises:
            RendezvousConnectionError: the store failed.
        """
        return self._open(self._read(), missing_ok=True)

    def set_state(self, state: bytes, token: Token = None) -> Optional[tuple[bytes, Token, bool]]:
        """Write ``state`` (torch's pickle of its state) if the store still holds ``token`` (the
        value read with it; ``None`` or ``b""``: if no state is stored). Returns the stored state,
        its token and whether this write took.

        Raises:
            RendezvousConnectionError: the store failed.
            pickle.UnpicklingError: ``state`` is not torch's pickle of its state.
        """
        mine = _from_torch(state)
        sealed = self._sealed(mine)
        expected = token if isinstance(token, bytes) else b""
        raw = self._call("compare_set", self.key, expected, sealed)
        if raw == sealed:
            self.seq, self.last = self.seq + 1, mine
            return state, sealed, True
        if expected and raw == expected:  # compare_set answers the expected value when the key is absent
            raw = b""
        opened = self._open(raw, missing_ok=True)
        return None if opened is None else (*opened, False)


def sealed_handler(params: Any, seal: Seal, on_refused: Callable[[str, str, str], None]) -> Any:
    """torch's ``DynamicRendezvousHandler`` for ``params`` (``RendezvousParameters`` of the
    ``c10d`` backend: its store made as torch makes it, ``store_type``, ``read_timeout``,
    ``is_host`` honoured) with its state in a :class:`SealedBackend`.

    Raises:
        ValueError: ``params.backend`` is not ``c10d`` (the only backend whose state is sealed).
        RendezvousConnectionError: the store cannot be reached or served.
        Incompatible: torch's state classes changed.
    """
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    if params.backend != "c10d":
        raise ValueError(f"--rdzv-backend {params.backend}: trainguard seals the state of the c10d backend only")
    _, store = c10d_rendezvous_backend.create_backend(params)  # torch's backend itself is not used
    backend = SealedBackend(store, params.run_id, seal, on_refused)
    return dynamic_rendezvous.create_handler(store, backend, params)


def security_events(events: Any) -> Callable[[str, str, str], None]:
    """An ``on_refused`` for :class:`SealedBackend`: a ``security`` event (``key``, ``what``,
    ``why``, ``detail``) in ``events`` (an :class:`~trainguard.events.EventLog`) and a console
    warning."""
    from .. import console

    def tell(key: str, why: str, detail: str) -> None:
        what = "a rendezvous state without this launch's seal was refused; the last verified one is kept"
        if why == "deleted":
            what = "the rendezvous state was deleted from the store; the last verified one is kept"
        events.emit("security", key=key, what=what, why=why, detail=detail[:200])
        console.warn(f"refused the rendezvous state in the store (key {key}, {why}: {detail[:200]}): {what}")

    return tell


__all__ = ["MAX_STATE_BYTES", "SealedBackend", "StateFormatError", "decode_state", "encode_state", "sealed_handler"]
