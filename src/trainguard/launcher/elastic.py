"""The one place where trainguard touches torch elastic's private members.

:class:`~trainguard.launcher.agent.TrainguardAgent` replaces the monitor loop of torch's
``LocalElasticAgent`` and needs more of it than its public API (``run()``) gives. Every private
member it uses is reached here and only here, behind a public name on :class:`ElasticAdapter`;
the members are listed in :data:`AGENT_METHODS`, :data:`AGENT_ATTRIBUTES` and
:data:`PCONTEXT_ATTRIBUTES`. They are not a stable API: a torch release may rename or remove any
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

# LocalElasticAgent (and SimpleElasticAgent) methods used or overridden here:
#   _invoke_run: the monitor loop that run() calls (overridden: runs monitor_loop())
#   _stop_workers: what torch's own code calls to stop the group (overridden: runs stop_group())
#   _initialize_workers: rendezvous + start of the group; _monitor_workers: one poll of the group
#   _exit_barrier: wait for the other nodes at the end; _shutdown: SIGTERM, wait, SIGKILL the workers
#   _rendezvous: the rendezvous part of _initialize_workers (extended: runs after_rendezvous() before
#   the workers start)
AGENT_METHODS = (
    "_invoke_run",
    "_stop_workers",
    "_initialize_workers",
    "_rendezvous",
    "_monitor_workers",
    "_exit_barrier",
    "_shutdown",
)
# attributes LocalElasticAgent.__init__ sets: the worker group, the restarts left, the process context
AGENT_ATTRIBUTES = ("_worker_group", "_remaining_restarts", "_pcontext")
# of the process context of workers started from a binary (SubprocessContext): {local_rank: handler}
# whose handler.proc is the worker's subprocess.Popen; the program, {local_rank: args} and
# {local_rank: env} each worker was started with (in-process recovery starts a replacement alike);
# {local_rank: path} of each worker's stderr file (teed there by the logs spec); the set of local
# ranks its poll still watches (a slot readmitted after a shrink is added back)
PCONTEXT_ATTRIBUTES = ("subprocess_handlers", "entrypoint", "args", "envs", "stderrs", "_running_local_ranks")


class ElasticIncompatible(RuntimeError):
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
