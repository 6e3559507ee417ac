"""The one place where trainguard touches torch elastic's private members.

:class:`~trainguard.launcher.agent.TrainguardAgent` replaces the monitor loop of torch's
``LocalElasticAgent`` and needs more of it than its public API (``run()``) gives. Every private
member it uses is reached here and only here, behind a public name on :class:`ElasticAdapter`;
the members are listed in :data:`AGENT_METHODS`, :data:`AGENT_ATTRIBUTES` and
:data:`PCONTEXT_ATTRIBUTES`, taken from :data:`trainguard.compat.MEMBERS` (the one list of the
private names trainguard uses). They are not a stable API: a torch release may rename or remove any
of them. So the adapter checks them when an agent is built (:class:`ElasticIncompatible` names the
missing member and the torch version), ``tests/test_elastic_adapter.py`` checks them against the
installed torch, and ``pyproject.toml`` admits only the torch releases CI has run (2.13).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Optional

import torch
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, Worker, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from .. import compat

# LocalElasticAgent (and SimpleElasticAgent) methods used or overridden here (listed in trainguard.compat):
#   _invoke_run: the monitor loop that run() calls (overridden: runs monitor_loop())
#   _stop_workers: what torch's own code calls to stop the group (overridden: runs stop_group())
#   _initialize_workers: rendezvous + start of the group; _monitor_workers: one poll of the group
#   _exit_barrier: wait for the other nodes at the end; _shutdown: SIGTERM, wait, SIGKILL the workers
#   _rendezvous: the rendezvous part of _initialize_workers (extended: runs after_rendezvous() before
#   the workers start); _assign_worker_ranks: its exchange of the nodes' worker counts, which a node
#   that joins the running group in place waits on (join_round() takes part in it)
AGENT_METHODS = compat.members(compat.AGENT, on_objects=False)
# attributes LocalElasticAgent.__init__ sets: the worker group, the restarts left, the process context,
# the rendezvous round's store (the exit barrier's)
AGENT_ATTRIBUTES = compat.members(compat.AGENT, on_objects=True)
# of the process context of workers started from a binary (SubprocessContext): {local_rank: handler}
# whose handler.proc is the worker's subprocess.Popen; the program, {local_rank: args} and
# {local_rank: env} each worker was started with (in-process recovery starts a replacement alike);
# {local_rank: path} of each worker's stderr file (teed there by the logs spec); the set of local
# ranks its poll still watches (a slot readmitted after a shrink is added back: private, in compat)
PCONTEXT_ATTRIBUTES = ("subprocess_handlers", "entrypoint", "args", "envs", "stderrs") + compat.members(compat.PCONTEXT)


class ElasticIncompatible(compat.Incompatible):
    """The installed torch lacks a private member of torch elastic that trainguard's launcher uses
    (the message names it and the torch version)."""


def missing_members(agent: Optional[LocalElasticAgent] = None, pcontext: Any = None) -> list[str]:
    """The members of :data:`AGENT_METHODS` (always), :data:`AGENT_ATTRIBUTES` (with ``agent``, a
    constructed agent) and :data:`PCONTEXT_ATTRIBUTES` (with ``pcontext``, a started process
    context of a binary, and ``.proc`` of its handlers) that are missing, as ``"Class.member"``."""
    missing = [f"LocalElasticAgent.{m}" for m in AGENT_METHODS if not callable(getattr(LocalElasticAgent, m, None))]
    if agent is not None:
        missing += [f"LocalElasticAgent.{a}" for a in AGENT_ATTRIBUTES if not hasattr(agent, a)]
    if pcontext is not None:
        cls = type(pcontext).__name__
        missing += [f"{cls}.{a}" for a in PCONTEXT_ATTRIBUTES if not hasattr(pcontext, a)]
        handlers = getattr(pcontext, "subprocess_handlers", None) or {}
        missing += [f"{type(h).__name__}.proc" for h in list(handlers.values())[:1] if not hasattr(h, "proc")]
    return missing


def check(agent: Optional[LocalElasticAgent] = None, pcontext: Any = None) -> None:
    """Raise :class:`ElasticIncompatible` when :func:`missing_members` finds any."""
    missing = missing_members(agent, pcontext)
    if missing:
        raise ElasticIncompatible(
            f"torch {torch.__version__} lacks {', '.join(missing)} of torch.distributed.elastic, which "
            f"trainguard's launcher relies on; trainguard is tested with torch 2.13 (see pyproject.toml)"
        )


class ElasticAdapter(LocalElasticAgent):
    """``LocalElasticAgent`` with public names for the private members a subclass needs.

    A subclass implements :meth:`monitor_loop` (run by ``run()`` instead of torch's loop) and
    :meth:`stop_group` (run wherever torch stops the workers). Arguments are ``LocalElasticAgent``'s.

    Raises:
        ElasticIncompatible: the installed torch lacks a member used here.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        check()
        super().__init__(*args, **kwargs)
        check(self)

    # ---- torch's hooks, routed to the subclass ---------------------------------------------------

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        return self.monitor_loop()

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self.stop_group()

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self.after_rendezvous()

    def monitor_loop(self) -> RunResult:
        """Start the group and supervise it until the launch ends (subclasses implement it)."""
        raise NotImplementedError

    def after_rendezvous(self) -> None:
        """Runs after each rendezvous, before the workers start (``worker_group.store`` is the
        rendezvous round's store, shared by every node's agent; ``worker_group.group_rank`` this
        node's rank). Does nothing unless a subclass overrides it."""

    def stop_group(self) -> None:
        """Stop the running group (subclasses implement it; see :meth:`shutdown_workers`)."""
        raise NotImplementedError

    # ---- the group -------------------------------------------------------------------------------

    @property
    def worker_group(self) -> WorkerGroup:
        """This node's worker group (its ``spec``, ``workers``, ``group_rank``, ``state``)."""
        return self._worker_group

    def workers(self) -> list[Worker]:
        """This node's workers (``local_rank``, ``global_rank``, ``world_size``)."""
        return list(self._worker_group.workers)

    @property
    def remaining_restarts(self) -> int:
        """Group restarts left in the budget (``max_restarts`` at start)."""
        return self._remaining_restarts

    @property
    def restart_count(self) -> int:
        """Restarts used so far: the attempt number of the running group (torch passes it to the
        workers as ``TORCHELASTIC_RESTART_COUNT``)."""
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def use_restart(self) -> None:
        """Take one restart from the budget (before starting the group again)."""
        self._remaining_restarts -= 1

    def start_workers(self) -> None:
        """Rendezvous with the other nodes and start this node's workers."""
        self._initialize_workers(self._worker_group)

    def poll_workers(self) -> RunResult:
        """One check of the workers: running, succeeded or failed (with exit codes)."""
        return self._monitor_workers(self._worker_group)

    def exit_barrier(self) -> None:
        """Wait (bounded) until every node's workers have finished."""
        self._exit_barrier()

    def shutdown_workers(self, timeout: int) -> None:
        """SIGTERM the workers' process groups, wait up to ``timeout`` seconds, SIGKILL the rest."""
        self._shutdown(timeout=timeout)

    def join_round(self) -> None:
        """Join the next rendezvous round while this node's workers keep running (the host of a
        join in place, see :mod:`trainguard.launcher.node_join`): the round's store, this node's
        group rank and the number of nodes become the group's (the exit barrier waits for every
        node of the round); the workers keep their processes and ranks. Takes part in torch's
        exchange of the nodes' worker counts, which the other nodes wait on.

        Raises:
            torch.distributed.elastic.rendezvous.RendezvousError: the round did not complete
                (``--rdzv-conf join_timeout``).
        """
        group = self._worker_group
        info = group.spec.rdzv_handler.next_rendezvous()
        self._store = info.store
        self._assign_worker_ranks(info.store, info.rank, info.world_size, group.spec)  # its numbers are not used
        group.store, group.group_rank, group.group_world_size = info.store, info.rank, info.world_size

    def start_as(self, ranks: tuple[int, ...], world_size: int, master: tuple[str, int], argv: list[str]) -> None:
        """Before :meth:`start_workers` (from :meth:`after_rendezvous`): this start's workers are the
        ranks ``ranks`` (local rank 0 first) of ``world_size``, meet on the store ``master``
        (``(host, port)``) and run the command line ``argv`` (entrypoint first) instead of the
        launch's. The launch's own command line comes back with :meth:`restore_args`."""
        group = self._worker_group
        for w in group.workers:
            w.global_rank = w.role_rank = ranks[w.local_rank]
            w.world_size = w.role_world_size = world_size
        group.master_addr, group.master_port = master
        self._launch_args = group.spec.args
        group.spec.args = tuple(argv[1:])

    def restore_args(self) -> None:
        """The launch's own command line for the next start (after :meth:`start_as`)."""
        if getattr(self, "_launch_args", None) is not None:
            self._worker_group.spec.args, self._launch_args = self._launch_args, None

    # ---- the worker processes --------------------------------------------------------------------

    def worker_processes(self) -> dict[int, subprocess.Popen]:
        """``{local_rank: Popen}`` of the current group's processes (empty before the first start).

        Raises:
            ElasticIncompatible: the process context holds no subprocess handlers.
        """
        if self._pcontext is None:
            return {}
        handlers = getattr(self._pcontext, "subprocess_handlers", None)
        if handlers is None:
            check(pcontext=self._pcontext)  # raises, naming the missing member
        return {r: h.proc for r, h in handlers.items()}

    def worker_command(self, local_rank: int) -> tuple[list[str], dict[str, str]]:
        """The command line and environment the worker of ``local_rank`` was started with."""
        pc = self._pcontext
        return [pc.entrypoint, *map(str, pc.args[local_rank])], dict(pc.envs[local_rank])

    def worker_stderr(self, local_rank: int) -> Optional[str]:
        """Path of the file the current group's worker of ``local_rank`` writes its stderr to
        (teed: it also reaches the console), or ``None`` (not teed, no group)."""
        if self._pcontext is None:
            return None
        return self._pcontext.stderrs.get(local_rank) or None

    def replace_process(self, local_rank: int, proc: subprocess.Popen) -> None:
        """Make ``proc`` the worker of ``local_rank`` (a replacement of a lost one): torch's poll,
        stop and shutdown then handle it as the worker."""
        self._pcontext.subprocess_handlers[local_rank].proc = proc
        next(w for w in self._worker_group.workers if w.local_rank == local_rank).id = proc.pid

    def withdraw(self, local_ranks: list[int], ranks: dict[int, int], world_size: int) -> None:
        """The group went on without the workers of ``local_ranks`` (a shrink, see
        :mod:`trainguard.rejoin.shrink`): each of their slots holds a finished process that exited
        0, so torch's poll counts it as done; every worker takes its global rank from ``ranks``
        (``{local_rank: global rank}``: a withdrawn one is numbered past the group, as torch keys
        its results by global rank) and the group's ``world_size`` (:meth:`renumber`)."""
        for local_rank in local_ranks:
            done = subprocess.Popen([sys.executable, "-S", "-c", ""])
            done.wait()
            self.replace_process(local_rank, done)
        self.renumber(ranks, world_size)

    def readmit(self, procs: dict[int, subprocess.Popen], ranks: dict[int, int], world_size: int) -> None:
        """Withdrawn slots take part again (the group grew back in place): ``procs`` (``{local_rank:
        process}``) become their workers, and every worker takes its rank from ``ranks`` and the
        group's ``world_size`` (:meth:`renumber`)."""
        for local_rank, proc in procs.items():
            self.replace_process(local_rank, proc)
            self._pcontext._running_local_ranks.add(local_rank)  # torch dropped it when its placeholder ended
        self.renumber(ranks, world_size)

    def renumber(self, ranks: dict[int, int], world_size: int) -> None:
        """Every worker takes its global rank from ``ranks`` (``{local_rank: global rank}``) and
        ``world_size``, in the worker objects and in the environment a later replacement of it
        starts with."""
        for w in self._worker_group.workers:
            w.global_rank = w.role_rank = ranks[w.local_rank]
            w.world_size = w.role_world_size = world_size
            env = self._pcontext.envs[w.local_rank]
            env.update(RANK=str(w.global_rank), ROLE_RANK=str(w.global_rank))
            env.update(WORLD_SIZE=str(world_size), ROLE_WORLD_SIZE=str(world_size))

    def worker_pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the current group's processes (empty before the first start)."""
        return {r: p.pid for r, p in self.worker_processes().items()}


__all__ = ["ElasticAdapter", "ElasticIncompatible", "check", "missing_members"]
