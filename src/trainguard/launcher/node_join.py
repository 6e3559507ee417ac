"""A node joins a running group in place: the agents' exchange in the rendezvous store.

With ``--nnodes MIN:MAX``, in-process recovery on and ``[elastic] min_ranks`` set, a node that
arrives while the group trains does not make every rank checkpoint and restart. The agent whose
group runs (the *host*) joins the new rendezvous round beside its running workers, and the nodes
of that round trade one record each in the round's store (:func:`announce`): whether their group
runs and how many workers they start. Torch numbers the nodes of a round by their address and
process id, so the host need not be node 0 of the new round; it is the one node that says it
runs (with none running, as at a launch, node 0 leads as before).

The host then numbers the newcomers after its own ranks, in the order of the nodes' group ranks
(:func:`number_newcomers`), publishes a generation that grows by them
(:attr:`~trainguard.rejoin.protocol.Generation.grown`) and leaves each joining node its
:class:`NodeJoin` (:func:`offer`): the recovery store, the group start's number, the generation
and the global rank of each of its local ranks. The joining agent starts its workers as newcomers
of that generation (:func:`read_offer`); the running ranks meet them at their next stop check and
send them the model, the optimizer and the shared state from memory (see
:mod:`trainguard.rejoin.shrink`).

Every value here is sealed with the launch's secret (:mod:`trainguard.rejoin.auth`): anyone who
reaches torch's rendezvous store can write its keys, and the key names repeat in every round and
launch. Each node's record carries a *challenge*, 16 random bytes drawn for the round; what the
leader or host leaves for the others (:func:`offer_store`, :func:`offer`) is sealed under a key
name that binds every record's challenge (:func:`bound`), and each node checks it against the
challenge it drew itself. A value from another round or launch, or one the reader's own record
is not in, does not open: it is refused with a ``security`` event (``on_forged``) and the reader
waits on for the real one within the store's timeout. The leader's offer carries the nonce of
its recovery store (:attr:`StoreOffer.nonce`), which every node then seals and opens the recovery
store's values under.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ..rejoin.auth import Seal
from ..rejoin.protocol import Generation

NODE_KEY = "trainguard/node/{}"  # + group rank: {"running": bool, "nproc": int, "host", "rendezvous", "challenge"}
JOIN_KEY = "trainguard/join/{}"  # + group rank: the NodeJoin the host leaves for a joining node
STORE_KEY = "trainguard/recovery_store"  # the leader's StoreOffer: its recovery store, group start and nonce
POLL = 0.05  # seconds between reads of a key whose value was refused

Refused = Callable[[str, str], None]  # told (key, why: "forged" or "replayed") of a refused value


@dataclass(frozen=True)
class NodeRecord:
    """What one node's agent says in a rendezvous round: whether its worker group runs (it is the
    host of a join in place), how many workers it starts (``--nproc-per-node``), its host name
    (the ranks' per-host reports name it), whether it serves torch's rendezvous store, and the
    round's challenge it drew (32 hex digits, :func:`bound`)."""

    running: bool
    nproc: int
    host: str = ""
    rendezvous: bool = False
    challenge: str = ""


@dataclass(frozen=True)
class StoreOffer:
    """What the leader offers the other nodes of a round: its recovery store's ``HOST:PORT``, the
    number of the group start (``TRAINGUARD_RECOVERY_GROUP``) and the nonce its values are sealed
    under (hex, ``TRAINGUARD_RECOVERY_NONCE``)."""

    address: str
    group: int
    nonce: str

    def to_json(self) -> str:
        return json.dumps({"address": self.address, "group": self.group, "nonce": self.nonce})

    @classmethod
    def from_json(cls, text: str | bytes) -> StoreOffer:
        d = json.loads(text)
        return cls(str(d["address"]), int(d["group"]), str(d["nonce"]))


@dataclass(frozen=True)
class NodeJoin:
    """What the host leaves for a node that joins its running group.

    Attributes:
        address: the recovery store's ``HOST:PORT`` (the host's).
        group: the number of the running group's start (``TRAINGUARD_RECOVERY_GROUP``).
        generation: the generation the group grows into.
        ranks: the global rank of each of the joining node's local ranks (local rank 0 first).
        nonce: the nonce the recovery store's values are sealed under (hex).
    """

    address: str
    group: int
    generation: Generation
    ranks: tuple[int, ...]
    nonce: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "address": self.address,
                "group": self.group,
                "generation": self.generation.to_json(),
                "ranks": self.ranks,
                "nonce": self.nonce,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeJoin:
        d = json.loads(text)
        return cls(
            str(d["address"]),
            int(d["group"]),
            Generation.from_json(d["generation"]),
            tuple(d["ranks"]),
            str(d.get("nonce", "")),
        )


def _told(key: str, why: str) -> None:
    pass


def read_sealed(store, name: str, seal: Seal, on_forged: Refused = _told, sealed_as: str = "") -> bytes:
    """The verified value of key ``name`` in ``store`` (sealed for the name ``sealed_as``, default
    ``name``): blocks until it is written; a value that does not open is refused (``on_forged``
    told ``name`` once per value) and the read goes on until the real one is there or the store's
    timeout has passed.

    Raises:
        torch.distributed.DistStoreError: no verified value within the store's timeout.
    """
    timeout = getattr(store, "timeout", timedelta(seconds=300)).total_seconds()
    deadline, refused = time.monotonic() + timeout, None
    while True:
        blob = store.get(name)  # blocks until the key exists, within the store's timeout
        value = seal.open(sealed_as or name, blob)
        if value is not None:
            return value
        if blob != refused:
            refused = blob
            on_forged(name, seal.why(sealed_as or name, blob))
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"no value of {name} with this launch's seal within {timeout:.0f} s")
        time.sleep(POLL)


def announce(
    store,
    group_rank: int,
    group_world_size: int,
    running: bool,
    nproc: int,
    seal: Seal,
    rendezvous: bool = False,
    on_forged: Refused = _told,
) -> list[NodeRecord]:
    """Say this node's :class:`NodeRecord` (with a fresh challenge) in the round's ``store``,
    sealed with ``seal``, and read every node's (in the order of their group ranks; blocks until
    all ``group_world_size`` nodes have said theirs; this node's own is the one it drew, never what
    the store holds).

    Raises:
        torch.distributed.DistStoreError: a node's record did not come within the store's timeout.
    """
    mine = NodeRecord(running, nproc, socket.gethostname(), rendezvous, secrets.token_hex(16))
    name = NODE_KEY.format(group_rank)
    store.set(name, seal.seal(name, json.dumps(mine.__dict__)))
    records = []
    for n in range(group_world_size):
        if n == group_rank:
            records.append(mine)
            continue
        r = json.loads(read_sealed(store, NODE_KEY.format(n), seal, on_forged))
        records.append(
            NodeRecord(bool(r["running"]), int(r["nproc"]), str(r["host"]), bool(r["rendezvous"]), str(r["challenge"]))
        )
    return records


def bound(key: str, records: list[NodeRecord]) -> str:
    """The name ``key`` is sealed under in a round whose nodes said ``records``: the key and a
    digest of every record's challenge, so a value from another round (or launch) does not open."""
    digest = hashlib.sha256(",".join(r.challenge for r in records).encode()).hexdigest()[:32]
    return f"{key}@{digest}"


def offer_store(store, records: list[NodeRecord], offer: StoreOffer, seal: Seal) -> None:
    """Leader: offer the other nodes of the round (``records``) its recovery store."""
    store.set(STORE_KEY, seal.seal(bound(STORE_KEY, records), offer.to_json()))


def read_store(store, records: list[NodeRecord], seal: Seal, on_forged: Refused = _told) -> StoreOffer:
    """The leader's :class:`StoreOffer` for this round (blocks; refused values as in
    :func:`read_sealed`).

    Raises:
        torch.distributed.DistStoreError: none with this round's seal within the store's timeout.
    """
    return StoreOffer.from_json(_read_bound(store, STORE_KEY, records, seal, on_forged))


def _read_bound(store, key: str, records: list[NodeRecord], seal: Seal, on_forged: Refused) -> bytes:
    """:func:`read_sealed` of ``key``, whose value is sealed under :func:`bound`'s name."""
    return read_sealed(store, key, seal, on_forged, sealed_as=bound(key, records))


def leader(records: list[NodeRecord]) -> int:
    """The group rank of the node that offers its recovery store to the others: the first whose
    launcher serves torch's rendezvous store, else 0."""
    return next((n for n, r in enumerate(records) if r.rendezvous), 0)


def host_of(records: list[NodeRecord]) -> int:
    """The group rank of the node whose group runs, else 0 (every node starts: node 0 leads).

    Raises:
        ValueError: more than one node says its group runs (two groups cannot merge).
    """
    running = [n for n, r in enumerate(records) if r.running]
    if len(running) > 1:
        raise ValueError(f"nodes {running} each say their worker group runs: two running groups cannot merge")
    return running[0] if running else 0


def number_newcomers(records: list[NodeRecord], host: int, world_size: int) -> dict[int, tuple[int, ...]]:
    """``{group rank: global ranks of its workers}`` for every node but the ``host``: numbered
    ``world_size``, ``world_size + 1``, ... (the running group's size before) in the order of the
    nodes' group ranks, each node's local ranks in order."""
    ranks, nxt = {}, world_size
    for node, record in enumerate(records):
        if node != host:
            ranks[node] = tuple(range(nxt, nxt + record.nproc))
            nxt += record.nproc
    return ranks


def offer(store, group_rank: int, join: NodeJoin, records: list[NodeRecord], seal: Seal) -> None:
    """Host: leave ``join`` for the node of ``group_rank`` in the round's ``store`` (sealed for
    the round whose nodes said ``records``)."""
    key = JOIN_KEY.format(group_rank)
    store.set(key, seal.seal(bound(key, records), join.to_json()))


def read_offer(store, group_rank: int, records: list[NodeRecord], seal: Seal, on_forged: Refused = _told) -> NodeJoin:
    """Joining node: the :class:`NodeJoin` the host left for it (blocks until it is there; a value
    without this round's seal is refused, ``on_forged`` told, and the read goes on).

    Raises:
        torch.distributed.DistStoreError: the host left none within the store's timeout.
    """
    return NodeJoin.from_json(_read_bound(store, JOIN_KEY.format(group_rank), records, seal, on_forged))
