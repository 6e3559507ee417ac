"""Whole nodes: which launchers are alive, which wait as spare nodes, which node was lost.

With ``trainguard run --nnodes MIN:MAX`` and ``[recovery] spare_nodes`` (the default), the group
trains on MIN nodes; a launcher that arrives beyond them (:func:`arrival`) is a **spare node**: it
starts its ``--nproc-per-node`` warm spares, says so in the leading node's recovery store
(:meth:`NodeRegistry.add_spare`) and waits (:mod:`.spare_node`). The recovery store is the
leading node's: the one whose launcher serves torch's rendezvous store (:func:`serves_endpoint`;
node 0 where none says so). Every launcher of the group says
which global ranks it runs (:meth:`NodeRegistry.set_active`) and beats from a thread of its own
every 0.1 s (:class:`Beat`: an atomic counter in the store; the group launcher's side of all this
is :mod:`.node_watch`). The leading node's launcher watches the others' counters (:class:`Silence`): one that has not moved for
``[recovery] node_timeout`` seconds is a lost node, whatever took it (its launcher SIGKILLed with
its ranks, a host that stopped answering). The membership state machine then decides
(:class:`~.membership.NodeLost`): a spare node takes the lost node's ranks in-process
(:meth:`NodeRegistry.take`), else the group restarts as before.

The leading node itself is not replaced: it hosts the recovery store and torch's rendezvous store,
whose loss ends torch elastic's job on every node (as with torchrun's c10d backend).

Values are sealed with the launch's secret (:mod:`trainguard.rejoin.auth`) like every recovery
key; the beat counters are atomic adds, which a seal cannot cover (a forged beat can hide a lost
node until the survivors' ``[recovery] timeout`` ends the wait: the group then restarts).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..rejoin.auth import Seal, read_now
from ..rejoin.protocol import Forged, connect, parse_address

BEAT_INTERVAL = 0.1  # seconds between a launcher's beats
PREFIX = "nodes/"
STORE_FILE = ".recovery-store"  # in the run directory: node 0's recovery store (HOST:PORT), for spare nodes


def agent_id() -> str:
    """This launcher's name in the registry: ``HOST:PID``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def arrival(endpoint: str, run_id: str, timeout: float) -> int:
    """The order in which this launcher arrived at the rendezvous (1, 2, ...): an atomic count in
    torch's rendezvous store at ``endpoint`` (``HOST:PORT``, the c10d backend's, which the
    endpoint's host serves once its rendezvous handler exists) under the job's ``run_id``. A new
    launch of the job starts a new store, and the count with it.

    Raises:
        torch.distributed.DistStoreError, RuntimeError: the store did not answer within ``timeout`` s.
    """
    host, port = parse_address(endpoint)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    return int(store.add(f"trainguard/{run_id}/arrivals", 1))


def serves_endpoint(endpoint: str) -> bool:
    """Whether this process listens on the port of ``endpoint`` (``HOST:PORT``): its launcher
    serves torch's rendezvous store (the c10d backend's host)."""
    import psutil

    port = parse_address(endpoint)[1]
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


@dataclass(frozen=True)
class ActiveNode:
    """A node of the running group: its host, the launcher's :func:`agent_id`, its global ranks."""

    host: str
    agent: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class SpareNode:
    """A spare node: its host, its launcher's :func:`agent_id`, and the ids its warm spares wait
    under in the recovery store (one per local rank, local rank 0 first)."""

    host: str
    agent: str
    spare_ids: tuple[int, ...]


@dataclass(frozen=True)
class Assignment:
    """What node 0 gave a spare node: the lost node's group rank, host and global ranks, and the
    generation the spare node's ranks join."""

    node: int
    lost_host: str
    ranks: tuple[int, ...]
    generation: int


class NodeRegistry:
    """The nodes' keys in the shared recovery store (not per group start: a spare node outlives a
    restart of the group).

    Args:
        store: the recovery store (node 0's TCPStore; server or client).
        seal: the launch's secret.
        on_forged: told the key of a value that did not verify (treated as absent).
    """

    def __init__(self, store: dist.Store, seal: Seal, on_forged: Forged = lambda key: None):
        self.store, self.seal, self.on_forged = store, seal, on_forged

    def _set(self, key: str, value: dict) -> None:
        name = PREFIX + key
        self.store.set(name, self.seal.seal(name, json.dumps(value)))
        self.store.check([name])  # answered after the set: the value is held (see RecoveryStore._set)

    def _get(self, key: str) -> Optional[dict]:
        name = PREFIX + key
        blob = read_now(self.store, name)  # no check-then-get: a key deleted between them waited out the timeout
        if blob is None:
            return None
        value = self.seal.open(name, blob)
        if value is None:
            self.on_forged(name)
            return None
        return json.loads(value)

    def set_active(self, group_rank: int, node: ActiveNode) -> None:
        """Launcher: node ``group_rank`` of the running group is ``node``."""
        self._set(f"active/{group_rank}", asdict(node))

    def active(self, group_rank: int) -> Optional[ActiveNode]:
        """Node 0: what node ``group_rank`` said of itself (``None``: nothing yet)."""
        d = self._get(f"active/{group_rank}")
        return None if d is None else ActiveNode(d["host"], d["agent"], tuple(d["ranks"]))

    def add_spare(self, host: str, agent: str, nproc: int) -> SpareNode:
        """Spare node: take a number and the ids of its ``nproc`` warm spares (beyond any node's
        own: ``1_000_000 × number + local rank + 1``), and say it waits."""
        number = int(self.store.add(PREFIX + "spares", 1))
        node = SpareNode(host, agent, tuple(1_000_000 * number + i + 1 for i in range(nproc)))
        self._set(f"spare/{number}", asdict(node))
        return node

    def spares(self) -> dict[int, SpareNode]:
        """Node 0: the spare nodes that said they wait and were not given a lost node's ranks."""
        count = int(self.store.add(PREFIX + "spares", 0))
        found = {}
        for number in range(1, count + 1):
            d = self._get(f"spare/{number}")
            if d is not None and self._get(f"spare/{number}/assigned") is None:
                found[number] = SpareNode(d["host"], d["agent"], tuple(d["spare_ids"]))
        return found

    def take(self, number: int, assignment: Assignment) -> None:
        """Node 0: spare node ``number`` takes a lost node's place (its warm spares were assigned)."""
        self._set(f"spare/{number}/assigned", asdict(assignment))

    def assignment(self, number: int) -> Optional[Assignment]:
        """Spare node: what node 0 gave it, ``None`` while it waits."""
        d = self._get(f"spare/{number}/assigned")
        return None if d is None else Assignment(d["node"], d["lost_host"], tuple(d["ranks"]), d["generation"])

    def finish(self) -> None:
        """Node 0: the job finished; waiting spare nodes may go."""
        self._set("finished", {})

    def finished(self) -> bool:
        """Spare node: whether the job finished."""
        return self._get("finished") is not None

    def end(self, agent: str) -> None:
        """Launcher: its launch ends (its ranks finished, or it stops): its beats stop now and it is
        not a lost node."""
        self._set(f"ended/{agent}", {})

    def ended(self, agent: str) -> bool:
        """Leading launcher: whether launcher ``agent`` said its launch ended (:meth:`end`)."""
        return self._get(f"ended/{agent}") is not None

    def beats(self, agent: str) -> int:
        """The beats launcher ``agent`` has sent so far."""
        return int(self.store.add(PREFIX + f"beat/{agent}", 0))


class Beat:
    """A launcher's liveness: a thread that adds 1 to its counter in the recovery store at
    ``address`` every :data:`BEAT_INTERVAL` seconds, on a connection of its own (the main loop may
    block in a rendezvous or a stop; only the process's end, or its host's, stops the beats)."""

    def __init__(self, address: str, agent: str):
        self.address, self.agent = address, agent
        self._stop = threading.Event()
        # not a daemon (a daemon caught inside a store call at exit aborts the process): it ends
        # with the main thread, within a beat and a store call
        self._thread = threading.Thread(target=self._run, name="trainguard-node-beat", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        store = None
        while not self._stop.wait(BEAT_INTERVAL) and threading.main_thread().is_alive():
            try:
                store = store or connect(*parse_address(self.address), 2.0)  # calls end within 2 s (stop())
                store.add(PREFIX + f"beat/{self.agent}", 1)
            except (RuntimeError, dist.DistError, OSError):  # slow or gone: try again, the leader judges
                store = None

    def stop(self) -> None:
        """End the beats and wait for the thread (a thread left inside a store call while the
        interpreter exits aborts the process)."""
        self._stop.set()
        self._thread.join(timeout=5.0)  # a store call ends within 2 s


class Silence:
    """Node 0's clock of the other launchers' beats: for each, the last count seen and when (its
    own monotonic clock: no two hosts' clocks are compared)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}

    def observe(self, agent: str, count: int, now: float) -> float:
        """Record ``agent``'s beat ``count`` read at ``now`` (seconds); returns for how long its
        count has not moved (0 at the first look and whenever it moved)."""
        last = self._seen.get(agent)
        if last is None or last[0] != count:
            self._seen[agent] = (count, now)
            return 0.0
        return now - last[1]

    def forget(self, agent: str) -> None:
        self._seen.pop(agent, None)
