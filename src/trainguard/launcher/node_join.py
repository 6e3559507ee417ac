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
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass

from ..rejoin.protocol import Generation

NODE_KEY = "trainguard/node/{}"  # + group rank: {"running": bool, "nproc": int}
JOIN_KEY = "trainguard/join/{}"  # + group rank: the NodeJoin the host leaves for a joining node


@dataclass(frozen=True)
class NodeRecord:
    """What one node's agent says in a rendezvous round: whether its worker group runs (it is the
    host of a join in place), how many workers it starts (``--nproc-per-node``) and its host name
    (the ranks' per-host reports name it)."""

    running: bool
    nproc: int
    host: str = ""
    rendezvous: bool = False


@dataclass(frozen=True)
class NodeJoin:
    """What the host leaves for a node that joins its running group.

    Attributes:
        address: the recovery store's ``HOST:PORT`` (the host's).
        group: the number of the running group's start (``TRAINGUARD_RECOVERY_GROUP``).
        generation: the generation the group grows into.
        ranks: the global rank of each of the joining node's local ranks (local rank 0 first).
    """

    address: str
    group: int
    generation: Generation
    ranks: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"address": self.address, "group": self.group, "generation": self.generation.to_json(), "ranks": self.ranks}
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeJoin:
        d = json.loads(text)
        return cls(str(d["address"]), int(d["group"]), Generation.from_json(d["generation"]), tuple(d["ranks"]))


def announce(
    store, group_rank: int, group_world_size: int, running: bool, nproc: int, rendezvous: bool = False
) -> list[NodeRecord]:
    """Say this node's :class:`NodeRecord` in the round's ``store`` and read every node's (in the
    order of their group ranks; blocks until all ``group_world_size`` nodes have said theirs).

    Raises:
        torch.distributed.DistStoreError: a node's record did not come within the store's timeout.
    """
    mine = {"running": running, "nproc": nproc, "host": socket.gethostname(), "rendezvous": rendezvous}
    store.set(NODE_KEY.format(group_rank), json.dumps(mine))
    records = [json.loads(store.get(NODE_KEY.format(n))) for n in range(group_world_size)]
    return [NodeRecord(bool(r["running"]), int(r["nproc"]), str(r["host"]), bool(r.get("rendezvous"))) for r in records]


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


def offer(store, group_rank: int, join: NodeJoin) -> None:
    """Host: leave ``join`` for the node of ``group_rank`` in the round's ``store``."""
    store.set(JOIN_KEY.format(group_rank), join.to_json())


def read_offer(store, group_rank: int) -> NodeJoin:
    """Joining node: the :class:`NodeJoin` the host left for it (blocks until it is there).

    Raises:
        torch.distributed.DistStoreError: the host left none within the store's timeout.
    """
    return NodeJoin.from_json(store.get(JOIN_KEY.format(group_rank)))
