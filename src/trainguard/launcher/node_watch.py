"""A group launcher's part in spare nodes (see :mod:`.nodes`): say which ranks it runs, beat, and
on the leading node watch the others' beats and hand a lost node's ranks to a spare node.

Composed into :class:`~trainguard.launcher.agent.TrainguardAgent` (``agent.nodes``); it holds the
node registry, the beat thread and the silence clock, and writes the ``node_lost`` and
``spare_node_assigned`` events. The decision between a spare node and a restart is the
membership state machine's (:class:`~.membership.NodeLost`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import torch.distributed as dist

from .. import console
from ..atomic import write_atomic
from ..events import EventLog
from ..launch_env import BOUNDARY_MIRROR, SPARE_NODES
from ..rundir import exclude_hosts
from .nodes import STORE_FILE, ActiveNode, Assignment, Beat, NodeRegistry, Silence, SpareNode, agent_id


class NodeWatch:
    """Spare nodes from one group launcher's side.

    Args:
        events: the launcher's event log (``RUN_DIR`` is its directory).
        node_timeout: ``[recovery] node_timeout`` (seconds of silence before a node is lost).
    """

    def __init__(self, events: EventLog, node_timeout: float):
        self.events, self.node_timeout = events, node_timeout
        self.registry: Optional[NodeRegistry] = None
        self.leading = False  # this launcher hosts the recovery store: it watches the others
        self.replaced = 0  # nodes a spare node replaced in this start of the group (outside torch's round)
        self._beat: Optional[Beat] = None
        self._silence = Silence()
        self._lost: set[int] = set()  # group ranks found lost in this start of the group
        self._records: dict[int, ActiveNode] = {}  # what the other nodes said (it changes only at a swap)

    def register(self, replacer, group_rank: int, group_world_size: int, ranks: tuple[int, ...]) -> None:
        """After a rendezvous (``replacer``: the agent's :class:`~.replace.Replacer`, its store
        shared): the leading launcher tells spare nodes where the store is; with several nodes,
        say this node's global ``ranks``, beat, and have the ranks mirror their boundary files
        unless this node leads."""
        self.leading = replacer.address == replacer.local_address
        if self.leading:
            write_atomic(self.events.path.parent / STORE_FILE, f"{replacer.address} {replacer.group_seal.nonce.hex()}")
        self._lost, self.replaced, self.registry, self._records = set(), 0, None, {}
        if group_world_size <= 1:
            return
        self.registry = NodeRegistry(replacer.shared, replacer.group_seal, replacer.forged)
        me = agent_id()
        self.registry.set_active(group_rank, ActiveNode(socket.gethostname(), me, ranks))
        if self._beat is None or self._beat.address != replacer.address:
            if self._beat is not None:
                self._beat.stop()
            self._beat = Beat(replacer.address, me)
        os.environ[BOUNDARY_MIRROR] = "" if self.leading else "1"
        os.environ[SPARE_NODES] = "1"

    def lost(self, group_rank: int, group_world_size: int) -> Optional[tuple[int, ActiveNode, bool]]:
        """The leading launcher, each poll: the first other node silent for ``node_timeout``
        (its ``node_lost`` event written, its host added to ``RUN_DIR/exclude_nodes``) as
        ``(group rank, its record, whether a spare node waits)``, else ``None``."""
        if self.registry is None or not self.leading:
            return None
        now = time.monotonic()
        for g in range(group_world_size):
            if g == group_rank or g in self._lost:
                continue
            node = self._records.get(g) or self.registry.active(g)
            if node is None or self.registry.ended(node.agent):
                continue
            self._records[g] = node
            silent = self._silence.observe(node.agent, self.registry.beats(node.agent), now)
            if silent <= self.node_timeout:
                continue
            self._lost.add(g)
            spares = len(self.registry.spares())
            self.events.emit(
                "node_lost",
                node=g,
                host=node.host,
                ranks=list(node.ranks),
                silent_seconds=round(silent, 3),
                spare_nodes=spares,
            )
            console.say(
                f"node {g} ({node.host}, rank(s) {list(node.ranks)}) lost: no beat for {silent:.1f} s; "
                + ("a spare node takes its place" if spares else "no spare node waits")
            )
            try:
                exclude_hosts(self.events.path.parent, [node.host])
            except OSError as e:
                console.say(f"could not add {node.host} to exclude_nodes: {e}")
            return g, node, spares > 0
        return None

    def spare(self) -> tuple[int, SpareNode]:
        """The first waiting spare node: its number and record.

        Raises:
            ValueError: none waits (the state machine decided on a spare that left since).
        """
        return min(self.registry.spares().items())

    def assigned(self, node: int, number: int, spare: SpareNode, ranks: tuple[int, ...], generation: int) -> None:
        """Spare node ``number`` took lost node ``node``'s ``ranks`` in ``generation``: record it
        (the spare node's launcher watches for it), watch the spare node in the lost one's place."""
        old = self.registry.active(node)
        self.registry.take(number, Assignment(node, old.host if old else "", ranks, generation))
        self._records[node] = ActiveNode(spare.host, spare.agent, ranks)
        self.registry.set_active(node, self._records[node])
        self._silence.forget(spare.agent)
        self._lost.discard(node)
        self.replaced += 1
        self.events.emit(
            "spare_node_assigned", node=node, host=spare.host, ranks=list(ranks), generation=generation, spare=number
        )

    def finished(self) -> None:
        """The group finished: waiting spare nodes may go (the leading launcher says so)."""
        if self.registry is not None and self.leading:
            self.registry.finish()

    def stop(self) -> None:
        """The launch ends: say so (its silence is not a lost node) and stop the beats."""
        if self._beat is None:
            return
        try:
            if self.registry is not None:
                self.registry.end(self._beat.agent)
        except (RuntimeError, dist.DistError):
            pass  # the leading node's store is gone: nobody watches
        self._beat.stop()
        self._beat = None
