"""The launcher ↔ rank protocol of in-process recovery, over one store the launcher hosts: a
``FileStore`` in its private directory on one node, a ``TCPStore`` across nodes (:mod:`.stores`).

Keys (all under ``attempt{N}/``, ``N`` the number of the worker group's start, counted by node 0's
launcher: a restart for a node that joined is a new start though torch's restart count stays):

* ``generations``: a counter; the launcher draws each generation's number from it.
* ``gen/{g}``: the JSON of :class:`Generation` ``g`` (``g`` = 1, 2, ...), written by the launcher
  once it has started the replacements; the survivors of generation ``g - 1`` wait for it.
* ``gen/{g}/ready/{rank}``: written by a newcomer of a grown generation once it has started and is
  about to meet the others; rank 0 lets the ranks grow only when every newcomer has.
* ``gen/{g}/accepted``: written by rank 0 when the ranks agreed to grow into generation ``g``.
* ``abandoned``: written by an agent that restarts its workers (a group restart): the others'
  ranks belong to a group that no longer forms, and a node that arrives is not taken into it.
* ``gen/{g}/joined/{rank}``: written by a replacement once it holds the transferred state (after
  a shrink: by every rank of the smaller group); the launcher counts the generation as formed when
  every member has written it.
* ``gen/{g}/stepped``: a counter each rank of generation ``g`` adds 1 to when it has completed its
  first step after joining it; the launcher counts the recovery as done (the progress rule,
  :mod:`trainguard.launcher.membership`) when it reaches the generation's world size. (A counter:
  not sealed, as ``generations`` is not.)
* ``gen/{g}/step_seconds``: the survivors' step time, written by the lowest survivor before it
  meets the replacements: the launcher's bound on the first step after the generation forms.
* ``gen/{g}/site``: where the survivors' first collective after the meeting is
  (:mod:`.align`), written by the lowest survivor when it reaches it; a replacement compares its
  own collectives with it.
* ``gen/{g}/failed``: why a rank of generation ``g`` gave the recovery up (the launcher's
  ``recovery_failed`` event quotes it).

and, for warm spares (not tied to a group attempt): ``spares/{id}/ready``, written by spare ``id``
once it waits in the script's ``init_process_group`` (its imports and set-up done), and
``spares/{id}``, the JSON environment of the rank it becomes (:func:`assign_spare`,
:func:`wait_for_assignment`, :func:`spare_ready`).

A generation is published either because ranks were lost (the survivors notice it in a collective
and wait for it) or because the group grows back in place after a shrink (:attr:`Generation.grown`:
the survivors learn of it at their next stop check, :meth:`RecoveryStore.peek`).

Each generation's process groups live on a store of their own (on one node a fresh file,
:attr:`Generation.path`; across nodes a fresh TCPStore server the launcher starts per generation,
:attr:`Generation.port`), so no key of an earlier generation can be read by a later one (stale
peer addresses break gloo's connect, pytorch issue 135712).

Every value above is sealed with the launch's secret and bound to the launch's nonce (:mod:`.auth`):
a value another process wrote, or one recorded in an earlier launch, is refused (treated as
absent; ``on_forged`` is told). On one node the stores are files no other user can open
(:mod:`.stores`); across nodes they listen on the launcher's address only (:func:`serve`), not on
every interface as a plain ``TCPStore`` server does.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from .auth import MAX_VALUE_BYTES, Seal, read_now
from .stores import connect, open_store, parse_address  # noqa: F401  (connect, parse_address: also read from here)

REFUSED_KEPT = 1024  # digests of refused values remembered (then forgotten: told again)

# Substrings of the errors gloo and NCCL raise in a collective whose peer is gone (the process died
# or its connection broke). An error without one is not treated as a lost peer: it propagates.
PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Write error",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "NCCL error",
)


# Substrings of the errors a backend raises for a collective called wrongly (NCCL's ncclInvalidUsage
# and ncclInvalidArgument, torch's checks before the call): the script's error, never a lost peer,
# even inside a DistBackendError.
USAGE_ERROR_MARKERS = (
    "invalid usage",
    "ncclInvalidUsage",
    "invalid argument",
    "ncclInvalidArgument",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's error about a lost peer (see :data:`PEER_FAILURE_MARKERS`):
    ``torch.distributed``'s backend and network errors, or a ``RuntimeError`` carrying a marker;
    never one that says the collective was called wrongly (:data:`USAGE_ERROR_MARKERS`)."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    if any(m in text for m in USAGE_ERROR_MARKERS):
        return False
    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    return any(m in text for m in PEER_FAILURE_MARKERS)


@dataclass(frozen=True)
class Generation:
    """One membership of the worker group after in-process recoveries.

    Attributes:
        number: 1 for the first recovery of a group start, then 2, 3, ...
        host, port: the store the generation's process groups are created on (several nodes).
        replaced: global ranks that are new processes in this generation.
        world_size: ranks in the generation (unchanged by a replacement, smaller after a shrink).
        left: global ranks of the previous generation that left it without a replacement (a
            shrink): the others are renumbered in order (:func:`new_rank`).
        grown: global ranks new to the group, numbered after the others (it grows back in place,
            see :mod:`.shrink`); also in ``replaced``. They take their own state from the lowest
            surviving rank by the rule of a resume on another world size.
        hosts: the host names of the ``grown`` ranks, in order, when they run on other nodes (a
            node that joined in place); empty: beside the ranks that send them the state.
        path: one node: the file of the ``FileStore`` the generation's process groups are created
            on (:func:`~.stores.group_store_path`; ``host`` and ``port`` are then unused); empty:
            the ``TCPStore`` at ``host:port``.
    """

    number: int
    host: str
    port: int
    replaced: tuple[int, ...]
    world_size: int
    left: tuple[int, ...] = ()
    grown: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    path: str = ""

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks that say they joined before the launcher counts the generation as formed: the
        replacements, or after a shrink every rank of the smaller group."""
        return self.replaced if self.replaced else tuple(range(self.world_size))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        d = json.loads(text)
        return cls(
            int(d["number"]),
            str(d["host"]),
            int(d["port"]),
            tuple(d["replaced"]),
            int(d["world_size"]),
            tuple(d.get("left", ())),
            tuple(d.get("grown", ())),
            tuple(d.get("hosts", ())),
            str(d.get("path", "")),
        )


def new_rank(rank: int, left: tuple[int, ...] | list[int]) -> int:
    """The rank that ``rank`` becomes when the ranks ``left`` leave the group: the survivors keep
    their order and close the gaps (ranks 0, 2 of 3 after rank 1 left: 0, 1)."""
    return rank - sum(1 for r in left if r < rank)


def listen_address(host: str) -> str:
    """The address a store that other nodes reach as ``host`` listens on: ``host``'s first
    address that is not loopback; every interface (``""``) when it resolves to loopback only
    (a node whose own name maps to ``127.0.1.1`` in ``/etc/hosts``, as Debian's does, while the
    other nodes resolve it through DNS). The values are sealed either way (:mod:`.auth`).

    Raises:
        OSError: ``host`` does not resolve.
    """
    addresses = [info[4][0] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)]
    return next((a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback), "")


def serve(host: str = "127.0.0.1") -> dist.TCPStore:
    """A new TCPStore server on a free port of ``host`` (the launcher's; read ``.port``), listening
    on that address only: a plain ``TCPStore`` server listens on every interface, so the socket is
    bound here and handed over (``master_listen_fd``). ``""``: every interface.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))  # "": every interface (listen_address)
    sock.listen(128)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here
    return dist.TCPStore(
        host or "0.0.0.0",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
        master_listen_fd=fd,
    )


Forged = Callable[[str], None]  # told the name of a key whose value was refused


def _ignore(key: str) -> None:
    pass


class RecoveryStore:
    """The ranks' and the launcher's view of the recovery keys of one group attempt.

    Args:
        store: the launcher's store (:func:`~.stores.open_store`: a FileStore on one node; a
            TCPStore across nodes, its server in the launcher).
        attempt: the number of the worker group's start (``TRAINGUARD_RECOVERY_GROUP``).
        seal: the launch's secret (:mod:`.auth`): every value written is sealed, every value read
            must verify.
        on_forged: told the key of a value whose seal did not verify (it is treated as absent).
    """

    def __init__(self, store: dist.Store, attempt: int, seal: Seal, on_forged: Forged = _ignore):
        self.store, self.prefix, self.seal, self.on_forged = store, f"attempt{attempt}/", seal, on_forged
        self._refused: set[tuple[str, bytes]] = set()  # (key, digest of the value) told once each

    def _set(self, key: str, value: str) -> None:
        """Write ``key`` and return once the server holds it: a TCPStore ``set`` is sent without a
        reply, so a read on another connection could come first; the ``check`` on this connection
        is answered after the ``set`` before it (one round trip)."""
        name = self.prefix + key
        self.store.set(name, self.seal.seal(name, value))
        self.store.check([name])

    def _get(self, key: str) -> Optional[bytes]:
        """The verified value of ``key``; ``None`` when absent, forged or above
        :data:`~.auth.MAX_VALUE_BYTES` (each such value told once). Never waits for the key.

        Raises:
            StoreReadError: the store failed.
        """
        name = self.prefix + key
        blob = read_now(self.store, name)  # no check-then-get: a key deleted between them waited out the timeout
        if blob is None:
            return None
        value = self.seal.open(name, blob) if len(blob) <= MAX_VALUE_BYTES else None
        seen = (name, hashlib.sha256(blob).digest())  # a digest: refused values are not kept
        if value is None and seen not in self._refused:
            if len(self._refused) >= REFUSED_KEPT:
                self._refused.clear()
            self._refused.add(seen)
            self.on_forged(name)
        return value

    def next_number(self) -> int:
        """Launcher: draw the next generation number (1, 2, ... per group attempt; atomic, so two
        nodes' agents never publish the same one)."""
        return int(self.store.add(self.prefix + "generations", 1))

    def publish(self, gen: Generation) -> None:
        """Launcher: announce generation ``gen`` (after its replacements were started)."""
        self._set(f"gen/{gen.number}", gen.to_json())

    def wait(self, number: int, timeout: float) -> Optional[Generation]:
        """Rank: generation ``number`` once published by the launcher, or ``None`` after
        ``timeout`` seconds (a forged value is refused and the wait goes on)."""
        value = self._wait(f"gen/{number}", timeout)
        return None if value is None else Generation.from_json(value)

    def _wait(self, key: str, timeout: float) -> Optional[bytes]:
        """The verified value of ``key`` once it is written, or ``None`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.store.wait([self.prefix + key], timedelta(seconds=left))
            except (RuntimeError, dist.DistStoreError):  # the store's timeout
                return None
            if (value := self._get(key)) is not None:
                return value
            time.sleep(0.05)  # forged: the real value overwrites it
        return None

    def node_lost(self, number: int) -> None:
        """Launcher: generation ``number`` replaces a lost node's ranks; said before it is published,
        so that ranks waiting on a silent host's peer cut their connections (:mod:`.notice`)."""
        self._set(f"gen/{number}/node_lost", "1")

    def was_node_lost(self, number: int) -> bool:
        """Rank: whether :meth:`node_lost` was said for generation ``number`` (one look)."""
        return self._get(f"gen/{number}/node_lost") is not None

    def survivors_at(self, number: int, step: int) -> None:
        """Survivor: the survivors meet generation ``number`` at step boundary ``step`` (completed
        steps), for a replacement that must know it before it meets them (:mod:`trainguard.hf`)."""
        self._set(f"gen/{number}/step", str(step))

    def survivor_where(self, number: int, rank: int, step: int, passes: int) -> None:
        """Survivor ``rank``: where it meets generation ``number``: its step boundary (completed
        steps) and the backward passes of the step it would all-reduce again (roll forward,
        :mod:`.forward`; -1: the first forward's broadcast; 0: none, the step done again or complete)."""
        self._set(f"gen/{number}/where/{rank}", f"{step} {passes}")

    def survivors_where(self, number: int, ranks: list[int], timeout: float) -> Optional[dict[int, tuple[int, int]]]:
        """``{rank: (step, passes)}`` of :meth:`survivor_where` for each of ``ranks``, or ``None``
        when one did not say within ``timeout`` seconds in all."""
        deadline, where = time.monotonic() + timeout, {}
        for rank in ranks:
            value = self._wait(f"gen/{number}/where/{rank}", max(0.0, deadline - time.monotonic()))
            if value is None:
                return None
            step, passes = value.split()
            where[rank] = (int(step), int(passes))
        return where

    def survivors_step(self, number: int, timeout: float) -> Optional[int]:
        """Replacement: the step boundary of :meth:`survivors_at`, or ``None`` after ``timeout`` seconds."""
        value = self._wait(f"gen/{number}/step", timeout)
        return None if value is None else int(value)

    def peek(self, number: int) -> Optional[Generation]:
        """Rank: generation ``number`` if it is published now, else ``None`` (no waiting)."""
        value = self._get(f"gen/{number}")
        return None if value is None else Generation.from_json(value)

    def accept(self, number: int) -> None:
        """Rank 0: the ranks agreed to grow into generation ``number`` (the launcher times it from now)."""
        self._set(f"gen/{number}/accepted", "1")

    def accepted(self, number: int) -> bool:
        """Launcher: whether the ranks agreed to grow into generation ``number``."""
        return self._get(f"gen/{number}/accepted") is not None

    def ready(self, number: int, rank: int) -> None:
        """Newcomer: rank ``rank`` of generation ``number`` has started (its imports and the
        script's set-up done) and is about to meet the others."""
        self._set(f"gen/{number}/ready/{rank}", "1")

    def all_ready(self, gen: Generation) -> bool:
        """Rank 0: every newcomer of ``gen`` (:attr:`Generation.grown`) said :meth:`ready`, so the
        ranks can meet them without waiting for their start."""
        return all(self._get(f"gen/{gen.number}/ready/{r}") is not None for r in gen.grown)

    def abandon(self) -> None:
        """Launcher: this start of the group is given up (an agent restarts its workers); an agent
        whose ranks still run must not take arriving nodes into it (:meth:`abandoned`)."""
        self._set("abandoned", "1")

    def abandoned(self) -> bool:
        """Launcher: whether an agent gave this start of the group up (:meth:`abandon`)."""
        return self._get("abandoned") is not None

    def decline(self, reason: str) -> None:
        """Rank 0: in-process recovery does not apply to this group (``reason`` says why); the
        launcher restarts the group on a lost rank at once (:meth:`declined`)."""
        self._set("declined", reason)

    def declined(self) -> Optional[str]:
        """Launcher: why the ranks declined in-process recovery, ``None`` if they did not."""
        value = self._get("declined")
        return None if value is None else value.decode()

    def busy(self, node: int, at: float) -> None:
        """Launcher: a rank of node ``node`` is silent past its timeout but busy (slow, not hung), as
        its hang supervisor saw at wall time ``at`` (seconds since the epoch)."""
        self._set(f"busy/{node}", f"{at:.3f}")

    def busy_elsewhere(self, node: int, nodes: int, since: float) -> Optional[int]:
        """Launcher: another node (of ``nodes``) whose :meth:`busy` is as recent as ``since`` (wall
        time), ``None`` if none: the silent ranks of node ``node`` may be waiting for its rank."""
        for other in range(nodes):
            if other != node and (value := self._get(f"busy/{other}")) is not None and float(value) >= since:
                return other
        return None

    def mirror_boundary(self, rank: int, slot: int, data: bytes) -> None:
        """Rank: hold a copy of boundary slot ``slot`` of ``rank`` (its file's bytes, tens of kB)
        off the rank's node, for a spare node's replacement of it; returns once the store holds it."""
        self._set(f"boundary/{rank}/{slot}", data)

    def mirrored_boundary(self, rank: int, slot: int) -> Optional[bytes]:
        """Replacement: the copy :meth:`mirror_boundary` left of slot ``slot`` of ``rank``, ``None``
        when there is none (or it is forged)."""
        return self._get(f"boundary/{rank}/{slot}")

    def stepped(self, number: int) -> None:
        """Rank: this rank completed its first step after joining generation ``number``."""
        self.store.add(self.prefix + f"gen/{number}/stepped", 1)

    def steps_after(self, number: int) -> int:
        """Launcher: how many ranks completed a step after joining generation ``number`` (:meth:`stepped`).
        Read without writing (:func:`~.auth.read_now`; an ``add`` of 0 would append to a file store
        at every poll, for the whole launch where the ranks declined in-process recovery).

        A counter that holds no count (another writer's: counters are not sealed) reads as 0: the
        progress rule's bound then ends the recovery in a group restart.

        Raises:
            StoreReadError: the store failed.
        """
        raw = read_now(self.store, self.prefix + f"gen/{number}/stepped")
        return int(raw) if raw is not None and raw.isdigit() else 0

    def loop_state(self, number: int, rank: int, text: str) -> None:
        """Rank: its optimizer's hyperparameters at its first completed step after joining
        generation ``number`` (:mod:`.loop_check`, JSON, hundreds of bytes)."""
        self._set(f"gen/{number}/loop/{rank}", text)

    def loop_state_now(self, number: int, rank: int) -> Optional[str]:
        """Rank: what rank ``rank`` wrote with :meth:`loop_state`, ``None`` if nothing yet (no wait)."""
        value = self._get(f"gen/{number}/loop/{rank}")
        return None if value is None else value.decode()

    def waiting_at(self, number: int, rank: int, site: str) -> None:
        """Rank: in its first step after joining generation ``number``, it is in the script's
        collective at ``site`` (``""``: it left it; :meth:`~.align.Alignment.waiting`)."""
        self._set(f"gen/{number}/waiting/{rank}", site)

    def waiting_site(self, number: int, rank: int) -> Optional[str]:
        """Rank: the collective rank ``rank`` is in (:meth:`waiting_at`), ``None`` when in none."""
        value = self._get(f"gen/{number}/waiting/{rank}")
        return value.decode() or None if value is not None else None

    def survivors_step_time(self, number: int, seconds: float) -> None:
        """Lowest survivor: its step time (seconds, the decaying mean) as it meets generation ``number``."""
        self._set(f"gen/{number}/step_seconds", f"{seconds:.6f}")

    def step_time(self, number: int) -> Optional[float]:
        """Launcher: the survivors' step time of :meth:`survivors_step_time`, ``None`` if not written."""
        value = self._get(f"gen/{number}/step_seconds")
        return None if value is None else float(value)

    def reached(self, number: int, site: str) -> None:
        """Lowest survivor: the survivors' first collective after meeting generation ``number`` is at ``site``."""
        self._set(f"gen/{number}/site", site)

    def survivors_site(self, number: int, timeout: float) -> Optional[str]:
        """Replacement: the site of :meth:`reached`, or ``None`` after ``timeout`` seconds."""
        value = self._wait(f"gen/{number}/site", timeout)
        return None if value is None else value.decode()

    def give_up(self, number: int, reason: str) -> None:
        """Rank: the recovery into generation ``number`` failed on this rank (``reason``)."""
        self._set(f"gen/{number}/failed", reason)

    def gave_up(self, number: int) -> Optional[str]:
        """Launcher: why a rank gave up the recovery into generation ``number``, ``None`` if none did."""
        value = self._get(f"gen/{number}/failed")
        return None if value is None else value.decode()

    def joined(self, number: int, rank: int) -> None:
        """Replacement: say that rank ``rank`` holds its state in generation ``number``."""
        self._set(f"gen/{number}/joined/{rank}", "1")

    def all_joined(self, gen: Generation) -> bool:
        """Launcher: every member of ``gen`` (:attr:`Generation.members`) has said so."""
        return all(self._get(f"gen/{gen.number}/joined/{r}") is not None for r in gen.members)


def next_group(store: dist.Store) -> int:
    """Node 0's launcher: draw the number of a new start of the worker group (1, 2, ...), under which
    that start's keys go (``RecoveryStore(store, number)``)."""
    return int(store.add("groups", 1))


def assign_spare(store: dist.Store, spare_id: int, env: dict[str, str], seal: Seal) -> None:
    """Launcher: make spare ``spare_id`` the rank whose worker environment is ``env`` (only the
    variables :func:`~trainguard.launch_env.assignment` keeps travel: the rank's place, never the
    launcher's environment)."""
    from ..launch_env import assignment

    key = f"spares/{spare_id}"
    store.set(key, seal.seal(key, json.dumps(assignment(env))))


def spare_ready(store: dist.Store, spare_id: int, seal: Seal, on_forged: Forged = _ignore) -> bool:
    """Launcher: whether spare ``spare_id`` waits for its assignment (its start-up is done); a
    value that does not verify is not (``on_forged`` is told its key)."""
    key = f"spares/{spare_id}/ready"
    if not store.check([key]):
        return False
    if seal.open(key, store.get(key)) is None:
        on_forged(key)
        return False
    return True


def wait_for_assignment(
    store: dist.Store, spare_id: int, seal: Seal, on_forged: Forged = _ignore, poll: float = 60.0
) -> dict[str, str]:
    """Spare: say it is ready, then block until the launcher assigns this spare a rank; returns that
    rank's variables (a forged assignment is refused, ``on_forged`` told, and the wait goes on).
    (A spare whose launcher dies is killed by its parent-death signal, so this need not time out.)"""
    key, refused = f"spares/{spare_id}", b""
    store.set(f"{key}/ready", seal.seal(f"{key}/ready", "1"))
    while True:
        try:
            store.wait([key], timedelta(seconds=poll))
        except (RuntimeError, dist.DistStoreError):  # the wait's own timeout: keep waiting
            continue
        blob = store.get(key)
        value = seal.open(key, blob)
        if value is not None:
            return json.loads(value)
        if blob != refused:
            refused = blob
            on_forged(key)
        time.sleep(0.05)


def spare_store_from_environ() -> dist.Store:
    """The recovery store a spare finds in its environment (``TRAINGUARD_RECOVERY_STORE``).

    Raises:
        ValueError: the variable is missing or neither ``HOST:PORT`` nor ``file://PATH``.
        FileNotFoundError: a file store whose directory is gone (the launch ended).
    """
    from ..launch_env import RECOVERY_STORE

    return open_store(os.environ.get(RECOVERY_STORE, ""))
