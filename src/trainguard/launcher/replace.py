"""The launcher's side of in-process recovery (:mod:`trainguard.rejoin`): replace a lost rank.

The agent asks :meth:`Replacer.replace` when ranks exited with a failure while the others still
run. It starts one replacement process per lost rank, with the lost worker's command line and
environment plus:

* ``-m trainguard.rejoin.replacement`` before the script (DDP is constructed there without its
  initial broadcast: the state comes from the survivors);
* ``TRAINGUARD_JOIN`` = the new generation, and ``MASTER_ADDR``/``MASTER_PORT`` of the generation's
  own store with ``TORCHELASTIC_USE_AGENT_STORE=True``, so the script's ``init_process_group`` joins
  the group the survivors form (on one node the generation's store is a file instead, which the
  replacement runner gives that call: :func:`~trainguard.rejoin.stores.group_store_path`);

then publishes the generation. On several nodes every agent and rank uses node 0's recovery store
(:meth:`Replacer.share`); generation numbers are drawn from it, and the agent of the node that lost
a rank starts its replacement and the generation's store on its own node. A warm spare (``[launcher] spares``, started with the group and
waiting in the script's ``init_process_group``) is assigned the lost rank's environment instead of
starting a new process; a new spare is then started in the background. :meth:`poll` tells the agent when the replacements have joined, or
that recovery did not finish within its bound (the agent then restarts the group).

With ``[elastic] min_ranks`` a lost rank with no spare ready leaves a smaller group instead
(:meth:`shrink`); with ``[elastic] regrow`` a spare is started for each withdrawn rank, and once one
is ready the group grows back in place (:meth:`grow`; see :mod:`trainguard.rejoin.shrink`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from .. import console
from ..events import EventLog
from ..launch_env import BOUNDARY_MIRROR, HEARTBEAT_DIR, JOIN, RECOVERY_DIR, RECOVERY_NONCE, RECOVERY_STORE
from ..rejoin.auth import Seal, report_forged
from ..rejoin.protocol import (
    Generation,
    RecoveryStore,
    assign_spare,
    connect,
    next_group,
    parse_address,
    serve,
    spare_ready,
)
from ..rejoin.stores import RECOVERY_FILE, file_address, file_store, group_store_path
from ..sections import RecoverySection
from . import node_join
from .membership import Joined, Settled, SettleTimedOut, TimedOut
from .node_join import NodeJoin, StoreOffer

REPLACEMENT_MODULE = "trainguard.rejoin.replacement"
STORE_TIMEOUT = 60.0  # s: the bound of the launcher's own store operations (as serve()'s TCPStore)
SETTLE_STEPS = 3  # the first step after a recovery may take this many of the survivors' step times


# why a recovery failed when a rank gave it up (what the rank said follows)
GAVE_UP = "a rank gave the recovery up"


@dataclass(frozen=True)
class Settling:
    """A generation that formed (or that another node's agent published) and with which the group
    has not completed a step yet (the progress rule, :mod:`.membership`).

    Attributes:
        number, world_size: the generation and its ranks (each says :meth:`RecoveryStore.stepped`).
        since: ``time.monotonic()`` when the recovery began (the replacements were started, or
            the generation was first seen).
        deadline: ``time.monotonic()`` past which the recovery has failed without a completed step.
        bound: the seconds from the forming to the deadline (said when it passes).
    """

    number: int
    world_size: int
    since: float
    deadline: float
    bound: float


class Replacer:
    """Replaces lost ranks of this node's worker group in-process.

    Args:
        cfg: the ``[recovery]`` section.
        events: the launcher's event log.
        script: the training script's path as it appears in the workers' command line.
        boundary_dir: the node-local directory of the ranks' step-boundary files (removed by :meth:`close`).
        seal: the launch's secret and this launcher's nonce (:mod:`trainguard.rejoin.auth`): every
            value this agent writes to a store is sealed with it, every value it reads must verify
            (a value that does not is refused with a ``security`` event). Its own spares' values
            are bound to this launcher's nonce; the shared recovery store's to the nonce of the
            launcher that serves it (:attr:`group_seal`, from :meth:`share`).
        host: this node's address for the stores, as the other nodes reach it (loopback on one node).
        bind: the address the stores listen on (default ``host``; see
            :func:`~trainguard.rejoin.protocol.listen_address`).
        spares: warm spares to keep (``[launcher] spares``).
        min_ranks: ``[elastic] min_ranks`` (0: never shrink; the rule is in :mod:`.membership`).
        regrow: ``[elastic] regrow``: after a shrink, start a spare for each rank that left and grow
            back when it is ready (:meth:`grow`).
        store_dir: one node: the launcher's private directory (0700, node-local) in which the
            stores are files (:mod:`trainguard.rejoin.stores`; removed by :meth:`close`);
            ``None``: they are TCPStores on ``bind``.

    Stores: :attr:`server` (this agent's: the file ``store_dir/recovery``, or a TCPStore on a free
    port of ``bind``) holds the spares' assignments; the recovery keys of the group (generations,
    joins) are in node 0's (:meth:`share`).
    """

    def __init__(
        self,
        cfg: RecoverySection,
        events: EventLog,
        script: str,
        boundary_dir: Path,
        seal: Seal,
        host: str = "127.0.0.1",
        bind: Optional[str] = None,
        spares: int = 0,
        min_ranks: int = 0,
        regrow: bool = False,
        store_dir: Optional[Path] = None,
    ):
        self.cfg, self.events, self.script, self.boundary_dir, self.host = cfg, events, script, boundary_dir, host
        self.min_ranks, self.regrow = min_ranks, regrow
        self.seal, self.bind = seal, host if bind is None else bind
        self.group_seal = seal  # the shared recovery store's nonce (share())
        self._refused: set[str] = set()  # keys whose forged values were reported
        self.owed = 0  # spares started to grow back after a shrink, beyond [launcher] spares
        self.store_dir = store_dir
        if store_dir is not None:  # one node: no port another user of the node could connect to
            self.server = file_store(store_dir / RECOVERY_FILE, STORE_TIMEOUT)
            self.local_address = file_address(store_dir / RECOVERY_FILE)
        else:
            self.server = serve(self.bind)
            self.local_address = f"{host}:{self.server.port}"
        self.address = self.local_address  # of the recovery store the group shares (see share())
        self.shared = self.server
        self.serves_rendezvous = False  # this launcher serves torch's rendezvous store (then it leads: share())
        self.attempt = 0
        self.generation = 0
        self.seen = 0  # the newest generation whose membership this agent has taken (follow())
        self._mine: set[int] = set()  # numbers of the generations this agent drew
        self.pending: Optional[Generation] = None
        self.settling: Optional[Settling] = None  # formed, no completed step yet (the progress rule)
        self._deadline = 0.0
        self._started = 0.0
        self._said: Optional[str] = None  # what the rank that gave the last recovery up said
        self._stores: list = []  # the generations' stores (kept alive while their groups may use them)
        self.want_spares = spares
        self.spares: dict[int, subprocess.Popen] = {}  # spare id -> waiting process
        self._spare_ids = 0
        self._newcomers: list[int] = []  # pids of the spares of the last grow
        self._warm: list[int] = []  # ranks of the pending generation that warm spares took
        self._pids: dict[int, int] = {}  # {global rank: pid} of the pending generation's new processes
        self._node: Optional[str] = None  # the host of the spare node that the pending generation brings
        self._template: Optional[tuple[list[str], dict[str, str]]] = None
        self._refill = False  # start the spares that are due once the group completes a step
        self._declined: Optional[str] = (
            None  # why in-process recovery no longer applies (declined, given up): no spares
        )

    def recovery_store(self) -> RecoveryStore:
        """The recovery keys of the current group start, shared by every node (after :meth:`share`)."""
        return RecoveryStore(self.shared, self.attempt, self.group_seal, self.forged)

    def forged(self, key: str, why: str = "") -> None:
        """A value in a store did not carry this launch's seal: refused; said once per key."""
        if key not in self._refused:
            self._refused.add(key)
            report_forged(self.events, key, why)

    def share(
        self, rdzv_store, group_rank: int, group_world_size: int, nproc: int
    ) -> tuple[str, int, Optional[NodeJoin]]:
        """After a rendezvous, before this node's workers start: the nodes trade their records
        (:func:`~.node_join.announce`; ``nproc``: this node's workers). When another node's group
        runs, this node joins it in place: it takes that node's recovery store and group start and
        returns the :class:`~.node_join.NodeJoin` the host left for it. Otherwise node 0
        (``group_rank`` 0) offers its recovery store and the number of this group start (the keys'
        prefix; it counts every start, also a restart for a node that joined, which torch's restart
        count does not) to the others through the round's store ``rdzv_store`` (not node 0 but the
        node that serves torch's rendezvous store, where one says so: :attr:`serves_rendezvous`;
        losing that node ends torch elastic's job anyway, so no other node's loss takes the
        recovery store with it); the others connect
        to it, and generations count from 0 again. Returns the shared store's address
        (``HOST:PORT``), the start's number (the workers' ``TRAINGUARD_RECOVERY_STORE`` and
        ``TRAINGUARD_RECOVERY_GROUP``) and the join, or ``None``.

        Raises:
            torch.distributed.DistStoreError: the other nodes' values did not come within the store's timeout.
            ValueError: two nodes say their groups run.
        """
        rdzv_seal = self.seal.under(b"")  # the round's values: bound to the round's challenges instead
        records = node_join.announce(
            rdzv_store, group_rank, group_world_size, False, nproc, rdzv_seal, self.serves_rendezvous, self.forged
        )
        host = node_join.host_of(records)
        running = records[host].running
        join = node_join.read_offer(rdzv_store, group_rank, records, rdzv_seal, self.forged) if running else None
        if join is not None:
            shared = StoreOffer(join.address, join.group, join.nonce)
        elif group_rank == node_join.leader(records):
            shared = StoreOffer(self.local_address, next_group(self.server), self.seal.nonce.hex())
            node_join.offer_store(rdzv_store, records, shared, rdzv_seal)
        else:
            shared = node_join.read_store(rdzv_store, records, rdzv_seal, self.forged)
        address, number = shared.address, shared.group
        self.group_seal = self.seal.under(bytes.fromhex(shared.nonce))
        if address == self.local_address:
            self.address, self.shared = address, self.server
        elif address != self.address:
            self.address, self.shared = address, connect(*parse_address(address), self.cfg.timeout)
        self.attempt, self.generation, self.pending, self.owed = number, 0, None, 0
        self.settling = None
        self.seen, self._mine = (join.generation.number if join else 0), set()
        self._stores.clear()
        for path in self.store_dir.glob("group-*") if self.store_dir is not None else ():
            path.unlink(missing_ok=True)  # the previous start's generations: its ranks are gone
        for sid in list(self.spares)[self.want_spares :]:  # started to grow back the previous group
            self.spares.pop(sid).kill()
        return self.address, number, join

    def abandon(self) -> None:
        """Say in the shared store that this start of the group is given up (this agent restarts its
        workers), so that no other agent takes an arriving node into it; nothing when the store's
        node is gone."""
        self.pending, self.settling = None, None
        try:
            self.recovery_store().abandon()
        except (RuntimeError, dist.DistError):
            pass

    def abandoned(self) -> bool:
        """Whether an agent gave this start of the group up (:meth:`abandon`); ``True`` when the
        shared store cannot be reached (its node, node 0 of the start, is gone)."""
        try:
            return self.recovery_store().abandoned()
        except (RuntimeError, dist.DistError):
            return True

    def admit(self, rdzv_store, group_rank: int, group_world_size: int, world_size: int) -> Optional[Generation]:
        """Host of a join in place (this node's group runs, and it has joined the new rendezvous
        round beside it, as node ``group_rank`` of ``group_world_size``): number the other nodes'
        workers after the group's ``world_size`` ranks (:func:`~.node_join.number_newcomers`),
        publish the generation that grows by them and leave each node its
        :class:`~.node_join.NodeJoin` in the round's store ``rdzv_store``. The ranks learn of the
        generation at their next stop check; :meth:`poll` times it from their agreement. Not
        counted against ``[recovery] max_replacements`` (no slot failed). Returns the generation,
        or ``None`` when the round has no other node (the arriving ones left before it formed).

        Raises:
            torch.distributed.DistStoreError: the other nodes' records did not come within the store's timeout.
            ValueError: another node says its group runs too.
        """
        rdzv_seal = self.seal.under(b"")
        records = node_join.announce(rdzv_store, group_rank, group_world_size, True, 0, rdzv_seal, False, self.forged)
        newcomers = node_join.number_newcomers(records, node_join.host_of(records), world_size)
        ranks = tuple(r for node in sorted(newcomers) for r in newcomers[node])
        if not ranks:
            return None
        hosts = tuple(records[node].host for node in sorted(newcomers) for _ in newcomers[node])
        gen = self._next_generation(ranks, world_size + len(ranks), grown=ranks, hosts=hosts)
        for node, node_ranks in newcomers.items():
            join = NodeJoin(self.address, self.attempt, gen, node_ranks, self.group_seal.nonce.hex())
            node_join.offer(rdzv_store, node, join, records, rdzv_seal)
        self._publish(gen)
        self._newcomers = []  # on the other nodes: their agents start them
        self.events.emit(
            "grow_started",
            generation=gen.number,
            ranks=list(ranks),
            world_size=gen.world_size,
            nodes={str(node): list(r) for node, r in newcomers.items()},
        )
        return gen

    def forming(self) -> set[int]:
        """Process ids of the newcomers of a grow that has not formed yet (they take no stop signal:
        they have no handler until their Guard exists, and the others' agreed stop covers them)."""
        return set(self._newcomers) if self.pending is not None and self.pending.grown else set()

    def fill_spares(self, argv: list[str], env: dict[str, str], now: bool = True) -> None:
        """Keep ``[launcher] spares`` spares waiting; ``argv``/``env``: a worker's command line and
        environment (its rank variables are replaced at assignment). ``now=False``: start them
        once the group has completed a step (:meth:`poll` sees it settle): a restarted group's
        ranks start faster without a spare's start-up (seconds of CPU: importing torch) beside
        them, and before that step a lost rank restarts the group anyway (the progress rule)."""
        self._template = (argv, env)
        if self._declined is not None:  # a lost rank restarts the group: a spare would serve nothing
            return
        if not now:
            self._refill = True
            return
        for sid, proc in list(self.spares.items()):
            if proc.poll() is not None:  # a spare that died (its script failed early): forget it
                del self.spares[sid]
        while len(self.spares) < self.want_spares + self.owed:
            self._spare_ids += 1
            cmd = replacement_command(argv, self.script, ["--spare", str(self._spare_ids)])
            # assigned here, by this agent, under its own nonce (the assignment carries the group's)
            spare_env = {**os.environ, **env, RECOVERY_STORE: self.local_address, RECOVERY_NONCE: self.seal.nonce.hex()}
            self.spares[self._spare_ids] = subprocess.Popen(cmd, env=spare_env, start_new_session=True)

    def declined(self) -> Optional[str]:
        """Why in-process recovery does not apply any more, or ``None``: the ranks declined it
        (:meth:`RecoveryStore.decline`), or a recovery of this launch failed because a rank gave it
        up (:meth:`_gave_up`)."""
        return self._declined or self.recovery_store().declined()

    def ready_spares(self) -> list[int]:
        """Ids of the spares that are alive and wait for an assignment (their start-up done)."""
        return [
            sid
            for sid, p in self.spares.items()
            if p.poll() is None and spare_ready(self.server, sid, self.seal, self.forged)
        ]

    def shrink(self, left: list[int], world_size: int) -> Generation:
        """Publish the generation in which the others go on without the global ranks ``left``
        (renumbered in order, :func:`~trainguard.rejoin.protocol.new_rank`); ``world_size``: the
        group's size before. With ``regrow``, start a spare for each of them. Returns the
        generation (its ``world_size`` is the smaller one)."""
        gen = self._next_generation((), world_size - len(left), tuple(sorted(left)))
        self._publish(gen)
        if self.regrow:
            self.owed += len(left)
            if self._template is not None:
                self.fill_spares(*self._template)
        self.events.emit(
            "recovery_started",
            generation=gen.number,
            ranks=[],
            left=list(gen.left),
            world_size=gen.world_size,
            pids={},
            warm=[],
        )
        return gen

    def grow(
        self, joining: dict[int, tuple[list[str], dict[str, str]]], world_size: int, spares: list[int]
    ) -> dict[int, subprocess.Popen]:
        """Assign the ready ``spares`` (ids from :meth:`ready_spares`, one per rank) to the ranks
        ``joining`` and publish the generation in which the group grows by them
        (:attr:`~trainguard.rejoin.protocol.Generation.grown`): the ranks learn of it at their next
        stop check and send the state. :meth:`poll` times the generation from the moment rank 0
        says the ranks agreed on it (their next stop check may be a long step away).

        Args:
            joining: ``{global rank: (command line, environment)}`` of withdrawn workers, numbered
                ``world_size``, ``world_size + 1``, ...
            world_size: the group's size before.
        Returns:
            ``{global rank: Popen}`` of the spares that became those ranks.
        """
        size = world_size + len(joining)
        ranks = tuple(sorted(joining))
        gen = self._next_generation(ranks, size, grown=ranks)
        procs = {}
        for rank, sid in zip(ranks, spares, strict=True):
            env = {**self._rank_env(joining[rank][1], gen), "RANK": str(rank), "ROLE_RANK": str(rank)}
            env.update(WORLD_SIZE=str(size), ROLE_WORLD_SIZE=str(size))
            assign_spare(self.server, sid, env, self.seal)
            procs[rank] = self.spares.pop(sid)
        self._publish(gen)
        self._newcomers = [p.pid for p in procs.values()]
        self.owed -= len(ranks)
        if self._template is not None:  # [launcher] spares, if any, waiting again
            self.fill_spares(*self._template)
        self.events.emit(
            "grow_started",
            generation=gen.number,
            ranks=list(ranks),
            world_size=size,
            pids={r: p.pid for r, p in procs.items()},
        )
        return procs

    def _next_generation(
        self,
        replaced: tuple[int, ...],
        world_size: int,
        left: tuple[int, ...] = (),
        grown: tuple[int, ...] = (),
        hosts: tuple[str, ...] = (),
    ) -> Generation:
        """The next generation: its number drawn from the shared store, a fresh store of its own (on
        one node a file its ranks make, :func:`~trainguard.rejoin.stores.group_store_path`)."""
        self.generation = self.recovery_store().next_number()
        self._mine.add(self.generation)
        path = group_store_path(self.address, self.attempt, self.generation)
        if path is not None:
            return Generation(self.generation, self.host, 0, replaced, world_size, left, grown, hosts, str(path))
        store = serve(self.bind)
        self._stores.append(store)
        return Generation(self.generation, self.host, store.port, replaced, world_size, left, grown, hosts)

    def follow(self) -> list[Generation]:
        """The generations other nodes' agents published since the last call, in order: this node's
        workers are numbered by them as the ranks are (a shrink, or a grow another agent hosts).
        One store look per call when nothing is new."""
        store, found = self.recovery_store(), []
        while (gen := store.peek(self.seen + 1)) is not None:
            self.seen = gen.number
            if gen.number not in self._mine:
                found.append(gen)
                now, bound = time.monotonic(), 2 * self.cfg.timeout + 5.0  # it may still be forming there
                self.settling = Settling(gen.number, gen.world_size, now, now + bound, bound)
        return found

    def _rank_env(self, env: dict[str, str], gen: Generation) -> dict[str, str]:
        """A new process's environment as a rank of ``gen``: as torch starts a worker (the
        launcher's environment, then the worker's ``env``), joining ``gen`` on its store (a file:
        named by ``TRAINGUARD_JOIN`` and the recovery store's address, the worker's
        ``MASTER_ADDR``/``MASTER_PORT`` kept; else that TCPStore's address)."""
        tcp = {} if gen.path else {"MASTER_ADDR": gen.host, "MASTER_PORT": str(gen.port)}
        return {
            **os.environ,
            **env,
            RECOVERY_NONCE: self.group_seal.nonce.hex(),
            JOIN: str(gen.number),
            **tcp,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }

    def _publish(self, gen: Generation) -> None:
        """Announce ``gen`` to the ranks and follow it in :meth:`poll`."""
        self.recovery_store().publish(gen)
        self.pending = gen
        self._started, self._said = time.monotonic(), None
        # a grow is timed from the ranks' agreement (poll()): their next stop check may be a long step away
        self._deadline = float("inf") if gen.grown else self._started + self.cfg.timeout + 5.0

    def replace(
        self, lost: dict[int, tuple[list[str], dict[str, str]]], world_size: int
    ) -> dict[int, subprocess.Popen]:
        """Start a replacement for each lost rank and publish the new generation.

        Args:
            lost: ``{global_rank: (command line, environment)}`` of the lost workers.
            world_size: the group's world size.
        Returns:
            ``{global_rank: Popen}`` of the replacements.
        """
        gen = self._next_generation(tuple(sorted(lost)), world_size)
        procs, warm = {}, []
        for rank, (argv, env) in lost.items():
            env = self._rank_env(env, gen)
            spare = next((sid for sid, p in self.spares.items() if p.poll() is None), None)
            if spare is not None:
                assign_spare(self.server, spare, env, self.seal)
                procs[rank] = self.spares.pop(spare)
                warm.append(rank)
            else:  # cold: its own session, as torch starts workers (torch's stop signals the process group)
                procs[rank] = subprocess.Popen(replacement_command(argv, self.script), env=env, start_new_session=True)
        self._publish(gen)
        self._warm = warm
        self._pids = {r: p.pid for r, p in procs.items()}
        self.events.emit(
            "recovery_started",
            generation=gen.number,
            ranks=list(gen.replaced),
            pids={r: p.pid for r, p in procs.items()},
            warm=warm,
        )
        # the next spare starts once this generation joined (poll): started now, its imports and the
        # script's preamble would take CPU from the replacement's set-up and the survivors' recovery
        return procs

    def replace_node(
        self, lost: dict[int, dict[str, str]], world_size: int, spare_ids: tuple[int, ...], host: str
    ) -> Generation:
        """A spare node (on ``host``) takes a lost node's place: its warm spares, waiting under
        ``spare_ids`` in the shared recovery store (local rank 0 first), are assigned the global
        ranks of ``lost`` (``{global rank: a worker environment to take}``, in order) and the
        generation that replaces them is published. The environment keeps the spare node's own
        node-local directories (heartbeats, boundary files) and mirrors its boundary files (it
        may be lost in turn). Returns the generation."""
        gen = self._next_generation(tuple(sorted(lost)), world_size)
        for (_, env), sid in zip(sorted(lost.items()), spare_ids):
            env = {k: v for k, v in self._rank_env(env, gen).items() if k not in (HEARTBEAT_DIR, RECOVERY_DIR)}
            env[BOUNDARY_MIRROR] = "1"
            assign_spare(self.shared, sid, env, self.group_seal)
        self.recovery_store().node_lost(gen.number)  # ranks waiting on a silent host cut (rejoin.notice)
        self._publish(gen)
        self._warm, self._pids, self._node = list(gen.replaced), {}, host
        self.events.emit(
            "recovery_started",
            generation=gen.number,
            ranks=list(gen.replaced),
            pids={},
            warm=list(gen.replaced),
            host=host,
        )
        return gen

    def poll(self) -> Optional[Joined | TimedOut | Settled | SettleTimedOut]:
        """Follow a forming generation: :class:`~.membership.Joined` once every member joined (a
        ``generation_joined`` event), :class:`~.membership.TimedOut` with why recovery failed (not
        finished within ``[recovery] timeout`` + 5 s, for a grow from the ranks' agreement on it; or
        a rank gave it up),
        ``None`` while it forms or when none does; then follow it until the group has completed a
        step with it (:meth:`_settle`)."""
        if self.pending is None:
            return self._settle()
        store = self.recovery_store()
        # before the join: a loaded launcher may first look when the ranks have joined, done the
        # step, given up and begun to exit (the failure then is theirs, not their exit's)
        if (said := store.gave_up(self.pending.number)) is not None:  # at once, not at the rank's exit
            self.pending, self._node = None, None
            self._gave_up(said)
            return TimedOut(GAVE_UP)
        if store.all_joined(self.pending):
            now = time.monotonic()
            seconds = now - self._started
            hint = store.step_time(self.pending.number) or 0.0
            bound = max(self.cfg.timeout, SETTLE_STEPS * hint)
            self.settling = Settling(self.pending.number, self.pending.world_size, self._started, now + bound, bound)
            self.events.emit(
                "generation_joined",
                generation=self.pending.number,
                ranks=list(self.pending.replaced),
                seconds=round(seconds, 4),
            )
            if self._node is not None:
                console.say(
                    f"replaced in-process: rank(s) {list(self.pending.replaced)} of the lost node by spare node "
                    f"{self._node} in {seconds:.2f} s; the other nodes' ranks kept their processes"
                )
            elif not self.pending.grown and not self.pending.left:
                how = "warm spare" if self._warm else "cold start"
                by = ", ".join(f"rank {r} by a {how} (pid {self._pids.get(r)})" for r in self.pending.replaced)
                console.say(f"replaced in-process: {by} in {seconds:.2f} s; the other ranks kept their processes")
            self.pending, self._node = None, None
            self._refill = True  # [launcher] spares waiting again, once the recovery settled
            return Joined()
        if self.pending.grown and self._deadline == float("inf") and store.accepted(self.pending.number):
            self._deadline = time.monotonic() + self.cfg.timeout + 5.0
        if time.monotonic() > self._deadline:
            why = f"generation {self.pending.number} did not form within {self.cfg.timeout + 5.0:.0f} s"
            self.pending, self._node = None, None
            return TimedOut(why)
        return None

    def started(self, world_size: int) -> None:
        """A new start of the group with ``world_size`` ranks: it settles until every rank has
        completed a step (generation 0's counter; no bound: a first step may compile for minutes)."""
        now = time.monotonic()
        self.settling, self._said = Settling(0, world_size, now, float("inf"), float("inf")), None

    def _settle(self) -> Optional[Settled | SettleTimedOut]:
        """The progress rule's watch of :attr:`settling`: :class:`~.membership.Settled` (a
        ``recovery_settled`` event) once every rank of the generation completed a step after it
        (:class:`Settling`), :class:`~.membership.SettleTimedOut` once its deadline passed without
        that step or a rank gave the recovery up (:meth:`RecoveryStore.give_up`: seen at once, not
        at the rank's exit, which takes seconds of teardown), else ``None``. Two store looks per
        poll until the step, none otherwise."""
        s = self.settling
        if s is None:
            return None
        now, store = time.monotonic(), self.recovery_store()
        if s.number == 0 and self._declined is None:  # a new start: did its ranks decline? (said before step 1)
            self._stop_spares_if_declined(store)
        if store.steps_after(s.number) >= s.world_size:
            self.settling = None
            if self._refill and self._template is not None:
                self._refill = False
                self.fill_spares(*self._template)
            if s.number > 0:  # generation 0: a new start of the group, no recovery
                self.events.emit("recovery_settled", generation=s.number, seconds=round(now - s.since, 4))
            return Settled()
        if s.number > 0 and (said := store.gave_up(s.number)) is not None:  # at once, not at the rank's exit
            self.settling = None
            self._gave_up(said)
            return SettleTimedOut(GAVE_UP)
        if now <= s.deadline:
            return None
        self.settling = None
        why = f"the group completed no step within {s.bound:.0f} s after generation {s.number} formed"
        gave_up = store.gave_up(s.number)
        return SettleTimedOut(f"{why} ({gave_up})" if gave_up else why)

    def _stop_spares_if_declined(self, store: RecoveryStore) -> None:
        """A new start of the group: if its ranks declined in-process recovery (NCCL without the
        abort path, :mod:`~trainguard.rejoin.backend_policy`; rank 0 says it at its start), stop
        the warm spares and start none from now on (:meth:`_no_more_spares`). One store read per
        poll until it is found or the group completed a step (declined ranks do not count their
        steps: then until the launch ends)."""
        if self._declined is None and (why := store.declined()) is not None:
            self._no_more_spares(why, f"in-process recovery does not apply ({why})")

    def _gave_up(self, said: str) -> None:
        """A rank gave the recovery under way up (:meth:`RecoveryStore.give_up`): the step done
        again got other inputs (:mod:`~trainguard.rejoin.redo_check`), the ranks' optimizers
        differ after it (:mod:`~trainguard.rejoin.loop_check`), or the replacement's collectives
        never met the survivors' (:mod:`~trainguard.rejoin.align`). Each is a property of the
        script's loop, so the next recovery would fail the same way: from now on a lost rank
        restarts the group at once (:meth:`declined`, a ``recovery_fallback`` with this reason),
        and no warm spare is kept. For this launch only: a new launch (a requeue) tries again."""
        self._said = said
        why = f"an in-process recovery of this launch failed by the loop's shape ({said})"
        self._no_more_spares(why, "an in-process recovery failed by the loop's shape")

    def _no_more_spares(self, why: str, said: str) -> None:
        """In-process recovery does not apply any more (``why``): stop the warm spares and start none
        from now on (a ``spares_stopped`` event; the console line ``said`` when one was running):
        a lost rank restarts the group, and a spare would hold a host's memory (a GPU's too, once it
        has a CUDA context) for nothing."""
        self._declined, self._refill = why, False
        stopped = sorted(p.pid for p in self.spares.values())
        for proc in self.spares.values():
            proc.kill()
            proc.wait()
        self.spares.clear()
        self.events.emit("spares_stopped", reason=why, pids=stopped)
        if stopped:
            console.say(f"warm spares stopped: {said}; a lost rank restarts the group")

    def failed(self) -> Optional[str]:
        """The recovery under way (forming or settling) failed, or the one that just failed (the
        agent's ``recovery_failed``): why a rank gave it up, as it said in the recovery store
        (:meth:`RecoveryStore.give_up`), or ``None``. A rank that gave it up found the loop's shape
        at fault, so from now on a lost rank restarts the group (:meth:`_gave_up`), whichever look
        saw the failure first: the store's word in :meth:`poll`, or the ranks' exits (a launcher
        that polls late sees both at once)."""
        gen = self.pending or self.settling
        if gen is None:
            return self._said
        try:
            said = self.recovery_store().gave_up(gen.number)
        except (RuntimeError, dist.DistError):
            return None
        if said is not None and self._declined is None:
            self._gave_up(said)
        return said

    def recovery_seconds(self) -> Optional[float]:
        """Seconds since the recovery under way began (its replacements were started), or ``None``."""
        if self.pending is not None:
            return time.monotonic() - self._started
        return time.monotonic() - self.settling.since if self.settling is not None else None

    def close(self) -> None:
        """Stop the spares, remove the boundary directory and the stores' (one node)."""
        for proc in self.spares.values():
            proc.kill()
            proc.wait()
        self.spares.clear()
        shutil.rmtree(self.boundary_dir, ignore_errors=True)
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)


def replacement_command(argv: list[str], script: str, options: tuple[str, ...] | list[str] = ()) -> list[str]:
    """A worker's command line with ``-m trainguard.rejoin.replacement [OPTIONS]`` before the script
    (once: a worker that started as a newcomer already has the module, without options).

    Raises:
        ValueError: ``script`` is not in ``argv``.
    """
    if script not in argv:
        raise ValueError(f"the script {script!r} is not in the worker's command line {argv!r}")
    i = argv.index(script)
    head = argv[: i - 2] if argv[i - 2 : i] == ["-m", REPLACEMENT_MODULE] else argv[:i]
    return [*head, "-m", REPLACEMENT_MODULE, *options, *argv[i:]]
