"""The launcher's changes of its worker group's membership while the ranks run (a part of
:class:`~trainguard.launcher.agent.TrainguardAgent`, kept apart for its length):

* a node waits in the rendezvous: take it in place (:meth:`MembershipChanges._admit_nodes`,
  :mod:`.node_join`) or through a checkpoint and a group restart
  (:meth:`MembershipChanges._checkpoint_for_membership`);
* a lost rank with no spare ready leaves a smaller group (:meth:`MembershipChanges._shrink`),
  and a ready spare takes its slot back (:meth:`MembershipChanges._grow_back`);
* another node's launcher changed the membership: number this node's workers as the ranks are
  (:meth:`MembershipChanges._follow`).

Whether and when to make each change is decided by the membership state machine
(:mod:`.membership`); these methods carry the decisions out. The agent holds what they share:
``replacer``, ``events``, ``monitor``, ``record`` and ``machine`` (whose state says which local
ranks the group went on without).
"""

from __future__ import annotations

import signal
import time
from typing import Any, Optional

from .. import console
from ..rejoin.protocol import Generation, new_rank
from .torch_agent import ElasticAdapter


class MembershipChanges(ElasticAdapter):
    """The membership changes of :class:`~trainguard.launcher.agent.TrainguardAgent` (see the module)."""

    @property
    def _withdrawn(self) -> list[int]:
        """Local ranks the group went on without (a shrink), until they grow back, in order."""
        return sorted(self.machine.state.withdrawn)

    def _checkpoint_for_membership(self, waiting: int) -> None:
        """``waiting`` nodes wait in the rendezvous to join (a node came back, or a new one): ask
        the ranks to stop at the next step boundary they agree on, with a checkpoint (SIGTERM, as a
        preemption); when they have exited with 75, :meth:`_handle_failure` restarts the group with
        the new membership, which resumes from that checkpoint on the new world size (no completed
        step lost; see ``docs/elastic.md``). Not counted against the restart budget."""
        self.events.emit("membership_change", nodes_waiting=waiting, checkpoint_first=True)
        console.say(
            f"{waiting} node(s) waiting to join: the ranks checkpoint at the next step boundary, then the "
            "group restarts with them"
        )
        self._forward(signal.SIGTERM)

    def _follow(self, gen: Generation) -> None:
        """Another node's agent published ``gen``: number this node's workers as the ranks now are
        (the gaps of ``gen.left`` closed, ``gen.world_size``), so that a later replacement, grow or
        join here starts with the group's numbers."""
        workers = {w.local_rank: w for w in self.workers()}
        live = {r: new_rank(w.global_rank, gen.left) for r, w in workers.items() if r not in self._withdrawn}
        self.renumber({**live, **self._past(gen.world_size)}, gen.world_size)

    def _admit_nodes(self, waiting: int) -> Optional[str]:
        """``waiting`` nodes wait in the rendezvous to join, and this node's ranks may change their
        world size in place: join the new rendezvous round beside the running workers and make
        this node the host of the join (:mod:`.node_join`): the other nodes' workers start as
        newcomers numbered after the group's ranks, which meet them at their next stop check and
        send them the state from memory. No rank stops, no step is redone. Returns why the join
        failed (the rendezvous or the exchange in its store: the group must restart), else ``None``
        (also when the waiting nodes left before the round formed: nothing changes)."""
        t0 = time.monotonic()
        self.events.emit("membership_change", nodes_waiting=waiting, in_place=True)
        console.say(f"{waiting} node(s) waiting to join: the group grows in place at the ranks' next stop check")
        workers = {w.local_rank: w for w in self.workers()}
        world_size = next(w.world_size for r, w in workers.items() if r not in self._withdrawn)
        try:
            self.join_round()
            group = self.worker_group
            gen = self.replacer.admit(group.store, group.group_rank, group.group_world_size, world_size)
        except Exception as e:  # torch's RendezvousError, a store's timeout, two running groups
            return f"the rendezvous with the arriving node(s) failed: {type(e).__name__}: {e}"
        if gen is None:
            console.say("the arriving node(s) left before the rendezvous round formed: the group goes on unchanged")
            return None
        live = {r: w.global_rank for r, w in workers.items() if r not in self._withdrawn}
        self.renumber({**live, **self._past(gen.world_size)}, gen.world_size)
        console.say(
            f"rank(s) {list(gen.grown)} on the joining node(s) take their state from the others: "
            f"{gen.world_size} rank(s) after the next stop check (rendezvous {time.monotonic() - t0:.2f} s)"
        )
        return None

    def _shrink(self, lost: list[int], workers: dict[int, Any], world_size: int, codes: list[Optional[int]]) -> None:
        """The group goes on without the ranks of ``lost`` (local ranks, exit ``codes``; ``workers``:
        this node's workers by local rank, ``world_size``: the group's size before); see
        :mod:`trainguard.rejoin.shrink`."""
        left = sorted(workers[r].global_rank for r in lost)
        gen = self.replacer.shrink(left, world_size)
        live = {r: new_rank(w.global_rank, left) for r, w in workers.items() if r not in self._withdrawn}
        self.withdraw(lost, {**live, **self._past(gen.world_size)}, gen.world_size)
        if self.monitor is not None:
            for r in lost:
                self.monitor.rank_withdrawn(r)
        if self.record is not None:
            self.record.write_ranks(self.worker_pids())
        console.say(
            f"rank(s) {left} lost (exit codes {codes}): "
            f"the other {gen.world_size} rank(s) go on as a smaller group, renumbered ([elastic] min_ranks = "
            f"{self.replacer.min_ranks})"
        )

    def _past(self, world_size: int) -> dict[int, int]:
        """``{local_rank: global rank}`` of the withdrawn workers: numbered past a group of
        ``world_size`` ranks, in the order of their local ranks."""
        return {r: world_size + i for i, r in enumerate(sorted(self._withdrawn))}

    def _grow_back(self, slots: tuple[int, ...]) -> None:
        """Ready spares take the withdrawn local ``slots`` back: they become ranks ``world_size``,
        ``world_size + 1``, ... of a larger group that the ranks meet at their next stop check (see
        :mod:`trainguard.rejoin.shrink`)."""
        workers = {w.local_rank: w for w in self.workers()}
        world_size = next(w.world_size for r, w in workers.items() if r not in self._withdrawn and r not in slots)
        spares = self.replacer.ready_spares()
        joining = {world_size + i: self.worker_command(r) for i, r in enumerate(slots)}
        started = self.replacer.grow(joining, world_size, spares[: len(slots)])
        size = world_size + len(slots)
        live = {r: w.global_rank for r, w in workers.items() if r not in self._withdrawn and r not in slots}
        ranks = {**live, **{r: world_size + i for i, r in enumerate(slots)}, **self._past(size)}
        self.readmit({r: started[world_size + i] for i, r in enumerate(slots)}, ranks, size)
        if self.monitor is not None:
            for r in slots:
                self.monitor.rank_returned(r)
        if self.record is not None:
            self.record.write_ranks(self.worker_pids())
        console.say(
            f"a spare is ready: the group grows back to {size} rank(s) at the ranks' next stop check, "
            f"rank(s) {sorted(joining)} taking their state from the others"
        )
