"""The per-node elastic agent behind ``trainguard run``.

It is torch's ``LocalElasticAgent`` (rendezvous, worker start/stop, restarts) with trainguard's
monitor loop in place of ``_invoke_run``:

* a worker group that fails because a rank died or crashed is restarted (``max_restarts``,
  default 3) and resumes from the newest valid checkpoint; the surviving ranks are SIGKILLed at
  once (after SIGCONT, for a stopped one): they cannot finish a collective or a save without the
  dead peer, and torch's own close would SIGTERM them and wait up to 30 s;
* with in-process recovery (``replacer``, :mod:`.replace`), a rank that dies while the others run
  (or that the hang supervisor killed) is replaced by a new process and the survivors keep running; a spent
  replacement budget falls back to the group restart above (``recovery_fallback``), and so does,
  by the progress rule, any failure of a recovery before the group has completed a step with it:
  a second failure while the generation forms or before that step, a generation that does not
  form in time, no completed step within the bound (``recovery_failed``);
* a rank that exits with a *decision* code is not restarted: 75 (requeue: the ranks stopped and
  saved), 2 (bad input), 76 (give up) end the launch with that code;
* SIGTERM, SIGUSR1 and SIGINT to the launcher are forwarded to every local rank, which saves and
  exits with 75; ranks still alive ``stop_grace`` seconds later are killed;
* every decision is an event in ``RUN_DIR/events.jsonl`` (rank ``null``).

``poll_hooks`` is the extension point for the hang supervisor: callables run every monitor
interval that may return a reason to restart the group (for example a missed heartbeat).

What it needs of torch's agent beyond ``run()`` comes through :mod:`trainguard.launcher.torch_agent`
(the only module that touches torch elastic's private members).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import time
from typing import Callable, Optional

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from .. import console
from ..events import EventLog
from ..exitcodes import ExitCode
from ..launch_env import JOIN, RECOVERY_GROUP, RECOVERY_NONCE, RECOVERY_STORE
from ..supervisor.monitor import HangMonitor
from . import deathsig, script_error
from .changes import MembershipChanges
from .jit import JitCollector
from .membership import (
    DECISION_CODES,
    Admit,
    AdmitFailed,
    CheckpointFirst,
    Collect,
    Collected,
    Decisions,
    End,
    Fallback,
    Finished,
    Followed,
    Forward,
    GiveUpRule,
    GroupStarted,
    GrowBack,
    Hang,
    Idle,
    Joined,
    KillSurvivors,
    Limits,
    Look,
    Machine,
    MembershipRestart,
    NodeLost,
    NodesWaiting,
    Progress,
    Replace,
    ReplaceNode,
    Restart,
    Settled,
    SettleTimedOut,
    Shrink,
    StopGraceExpired,
    StopRequested,
    TimedOut,
    failed,
    initial,
)
from .node_join import NodeJoin
from .node_watch import NodeWatch
from .record import LaunchRecord
from .replace import Replacer, replacement_command
from .script_error import ScriptError
from .torch_agent import ElasticAdapter

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
JIT_EXIT_WAIT = (
    2.0  # seconds a SIGKILLed rank gets to end before the just-in-time copies are made (state D outlives it)
)


class TrainguardAgent(MembershipChanges, ElasticAdapter):
    """``LocalElasticAgent`` with signal forwarding, decision exit codes and events.

    Args:
        events: the launcher's event log.
        stop_grace: seconds ranks get to save and exit after a forwarded stop signal
            (``[launcher] stop_grace``).
        kill_grace: seconds between SIGTERM and SIGKILL when the agent stops a group
            (``[supervisor] kill_grace``).
        monitor: the hang supervisor, or ``None`` when it is off.
        record: the launch's record of its processes, rewritten at each start of a group, or ``None``.
        replacer: in-process recovery of lost ranks, or ``None`` (off).
        spare_nodes: nodes beyond the group's wait as spare nodes (``[recovery] spare_nodes`` with
            ``--nnodes MIN:MAX``): node 0 watches the other nodes' beats and a spare node takes a
            lost node's ranks (:mod:`.nodes`).
        jit: the just-in-time save before a group restart (:mod:`.jit`), or ``None`` (off).
        (other arguments as ``LocalElasticAgent``)
    Raises:
        ElasticIncompatible: the installed torch lacks a member the agent relies on.

    After :meth:`run`, :attr:`exit_code` and :attr:`exit_reason` hold the launch's outcome.
    """

    def __init__(
        self,
        *args,
        events: EventLog,
        stop_grace: float,
        kill_grace: float = 30.0,
        monitor: Optional[HangMonitor] = None,
        record: Optional[LaunchRecord] = None,
        replacer: Optional[Replacer] = None,
        spare_nodes: bool = False,
        jit: Optional[JitCollector] = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.events = events
        self.stop_grace = stop_grace
        self.kill_grace = kill_grace
        self.monitor = monitor
        self.record = record
        self.replacer = replacer
        self.jit = jit
        self.exit_code = int(ExitCode.GIVE_UP)
        self.exit_reason = "not started"
        self.stop_signal: Optional[str] = None
        self.script_error: Optional[ScriptError] = None  # the launch ended on an error of the script
        self._stop_deadline: Optional[float] = None
        self._forwarded_to: set[int] = set()
        self._stopped_by_us: set[int] = set()  # local ranks SIGKILLed because a peer failed
        self._join: Optional[NodeJoin] = None  # this start joined another node's running group
        self.nodes = NodeWatch(events, replacer.cfg.node_timeout) if spare_nodes and replacer else None
        self.poll_hooks: list[Callable[[TrainguardAgent], Optional[str]]] = [monitor.poll] if monitor else []
        limits = Limits(
            in_process=replacer is not None,
            max_replacements=replacer.cfg.max_replacements if replacer else 0,
            max_restarts=self.worker_group.spec.max_restarts,
            min_ranks=replacer.min_ranks if replacer else 0,
            regrow=bool(replacer and replacer.regrow),
        )
        rule = GiveUpRule(
            monitor is not None,
            monitor.cfg.max_no_progress_restarts if monitor else 0,
            monitor.cfg.max_same_step_faults if monitor else 0,
            last_ckpt=monitor.newest_checkpoint() if monitor else None,
        )
        self.machine = Machine(initial(limits, 0, frozenset(), rule))  # who is in the group: the rules' state

    # ---- signals -------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """Handle SIGTERM/SIGUSR1/SIGINT in the launcher (torch elastic keeps SIGHUP/SIGQUIT)."""
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        first = self.stop_signal is None
        if first:
            self.stop_signal = signal.Signals(signum).name
            self._stop_deadline = time.monotonic() + self.stop_grace
        self._forward(signum)
        if first:  # the launch's own record of it: the ranks' stop_requested may never come (they had finished)
            self.events.emit("signal_received", signal=self.stop_signal, forwarded_to=sorted(self._forwarded_to))

    def _forward(self, signum: int) -> None:
        pids = set(self.worker_pids().values())
        if self.replacer is not None:
            pids -= self.replacer.forming()
        for pid in pids - self._forwarded_to:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        self._forwarded_to |= pids

    # ---- monitor loop --------------------------------------------------------------------------

    def stop_group(self) -> None:
        """Stop the group: SIGCONT (a stopped rank must be able to die), SIGTERM, ``kill_grace``, SIGKILL."""
        for pid in self.worker_pids().values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.shutdown_workers(timeout=max(1, math.ceil(self.kill_grace)))
        if self.monitor is not None:
            self.monitor.group_stopped()

    def after_rendezvous(self) -> None:
        """In-process recovery: every node's workers and replacers share node 0's recovery store
        and the number of this group start (they go from node 0's agent to the others through the
        rendezvous store); the workers find them in their environment. When another node's group
        runs, this node joins it in place (:mod:`.node_join`): its workers start as the newcomers
        of the generation that node's agent published, with the ranks it gave them."""
        if self.replacer is None:
            return
        group = self.worker_group
        address, number, join = self.replacer.share(
            group.store, group.group_rank, group.group_world_size, group.spec.local_world_size
        )
        nonce = self.replacer.group_seal.nonce.hex()  # the recovery store's launch nonce
        os.environ.update({RECOVERY_STORE: address, RECOVERY_GROUP: str(number), RECOVERY_NONCE: nonce})
        if self.monitor is not None and group.group_world_size > 1:  # a slow rank's node tells the others
            self.monitor.share_busy(self.replacer.recovery_store(), group.group_rank, group.group_world_size)
        self._join = join
        if self.nodes is not None:
            ranks = tuple(w.global_rank for w in group.workers)
            self.nodes.register(self.replacer, group.group_rank, group.group_world_size, ranks)
        if join is not None:
            gen = join.generation
            argv = replacement_command([group.spec.entrypoint, *group.spec.args], self.replacer.script)
            self.start_as(join.ranks, gen.world_size, (gen.host, gen.port), argv)
            os.environ[JOIN] = str(gen.number)

    def stop_beating(self) -> None:
        """The launch ends: the leading launcher must not take this one's silence for a lost node."""
        if self.nodes is not None:
            self.nodes.stop()

    def _replace_node(self, d: ReplaceNode) -> None:
        """**ReplaceNode**: the first waiting spare node's warm spares take the lost node's ranks
        (each with the environment of this node's worker of the same local rank, renamed), and
        the generation they join is published; the survivors meet them there."""
        number, spare = self.nodes.spare()
        template = {w.local_rank: self.worker_command(w.local_rank)[1] for w in self.workers()}
        lost = {}
        for local, rank in enumerate(d.ranks):
            env = dict(template[local % len(template)])
            env.update(RANK=str(rank), ROLE_RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=str(d.node))
            lost[rank] = env
        gen = self.replacer.replace_node(lost, self.workers()[0].world_size, spare.spare_ids, spare.host)
        self.nodes.assigned(d.node, number, spare, d.ranks, gen.number)

    def _start_group(self) -> None:
        self._forwarded_to = set()
        if self.monitor is not None:
            self.monitor.group_started(self.restart_count)
        try:
            self.start_workers()
        finally:
            self.restore_args()  # a node that joined a running group: the launch's own command next time
            os.environ.pop(JOIN, None)
        group = self.worker_group
        if self.replacer is not None:
            # at a restart, the spares start once the group has completed a step (Replacer.fill_spares)
            self.replacer.fill_spares(*self.worker_command(0), now=self.restart_count == 0)
            self.replacer.started(group.workers[0].world_size)  # settles at its first completed step
        local = frozenset(w.local_rank for w in self.workers())
        self.machine.feed(GroupStarted(group.workers[0].world_size, local))
        if self.monitor is not None:
            self.monitor.write_timeouts = group.group_rank == 0
        pids = self.worker_pids()
        if self.record is not None:
            self.record.write_ranks(pids)
        joined = {"joined_generation": self._join.generation.number} if self._join is not None else {}
        self.events.emit(
            "workers_started",
            restart=self.restart_count,
            pids=pids,
            world_size=group.workers[0].world_size,
            node=group.group_rank,
            nodes=group.group_world_size,
            **joined,
        )
        if self.stop_signal is not None:  # a signal that arrived during rendezvous
            self._forward(getattr(signal, self.stop_signal))

    def monitor_loop(self) -> RunResult:
        """Start the group, then poll it every ``monitor_interval`` until the launch ends. Each poll
        turns what the agent sees into events for the membership state machine
        (:mod:`.membership`, which decides) and carries its decisions out."""
        spec = self.worker_group.spec
        self._start_group()
        while True:
            time.sleep(spec.monitor_interval)
            result = self._poll()
            if result is not None:
                return result

    def _poll(self) -> Optional[RunResult]:
        """One poll: the events in order, each one's decisions carried out; stops at the first event
        that decided something. Returns the launch's result once it ends, else ``None``."""
        if self.stop_signal is not None and self.machine.state.stop is None:
            self._carry_out(self.machine.feed(StopRequested(self.stop_signal)))
        if self.replacer is not None:
            for gen in self.replacer.follow():
                self._follow(gen)
                self.machine.feed(Followed(gen.world_size))
            progress = self.replacer.poll()
            if isinstance(progress, TimedOut):
                return self._carry_out(self.machine.feed(TimedOut(progress.why, self._progress())))
            if isinstance(progress, SettleTimedOut):
                return self._carry_out(self.machine.feed(SettleTimedOut(progress.why, self._progress())))
            if isinstance(progress, Joined):
                self.machine.feed(progress)
            if isinstance(progress, Settled):  # with the newest checkpoint now (State.unproven)
                self.machine.feed(Settled(self._progress()))
            found = (
                self.nodes.lost(self.worker_group.group_rank, self.worker_group.group_world_size)
                if self.nodes
                else None
            )
            if found is not None:
                node, record, spare = found
                lost = NodeLost(f"node {node} ({record.host}) lost", node, record.ranks, spare, self._progress())
                return self._carry_out(self.machine.feed(lost))
        procs = self.worker_processes()
        codes = {r: p.poll() for r, p in procs.items()}  # one look per poll, for every rule
        failing = self.replacer is not None and any(failed(c) for c in codes.values())
        look = Look(
            codes,
            declined=self.replacer.declined() if failing else None,
            spares_ready=len(self.replacer.ready_spares()) if failing else 0,
            single_node=self.worker_group.group_world_size == 1,
            ending=failing
            and self.monitor is not None
            and self.monitor.ending(frozenset(r for r, c in codes.items() if c is not None)),
        )
        decisions = self.machine.feed(look)
        if decisions:
            return self._carry_out(decisions, procs, codes)
        if self.stop_signal and self._stop_deadline and time.monotonic() > self._stop_deadline:
            self.events.emit("stop_grace_expired", signal=self.stop_signal, grace=self.stop_grace)
            return self._carry_out(self.machine.feed(StopGraceExpired()))
        reason = next((r for hook in self.poll_hooks if (r := hook(self))), None)
        if reason is not None:
            self.events.emit("group_unhealthy", reason=reason)
            unkillable = bool(self.monitor is not None and self.monitor.unkillable)
            return self._carry_out(self.machine.feed(Hang(reason, unkillable, self._progress())))
        waiting = 0 if self.machine.state.regrowing else self.worker_group.spec.rdzv_handler.num_nodes_waiting()
        if waiting > 0:
            abandoned = self.replacer is not None and self.replacer.abandoned()
            return self._carry_out(self.machine.feed(NodesWaiting(waiting, abandoned, self._progress())))
        if self.machine.state.withdrawn and self.replacer is not None:
            return self._carry_out(self.machine.feed(Idle(len(self.replacer.ready_spares()))))
        return None

    def _progress(self) -> Progress:
        """The give-up rule's facts now: the failure step and the newest checkpoint (from the hang
        supervisor; none without it)."""
        if self.monitor is None:
            return Progress()
        return Progress(self.monitor.failure_step(), self.monitor.newest_checkpoint())

    def _carry_out(
        self,
        decisions: Decisions,
        procs: Optional[dict[int, subprocess.Popen]] = None,
        codes: Optional[dict[int, Optional[int]]] = None,
        result: Optional[RunResult] = None,
    ) -> Optional[RunResult]:
        """Do what the state machine decided, in order (``procs``/``codes``: the poll's look;
        ``result``: torch's, once collected); the launch's result when it ends, else ``None``."""
        for d in decisions:
            if isinstance(d, Fallback) and d.failed:
                self._recovery_failed(d.why, codes)
            elif isinstance(d, Fallback):
                lost = {r: c for r, c in (codes or {}).items() if failed(c)}
                self.events.emit("recovery_fallback", reason=d.why, exit_codes=lost)
                console.say(f"in-process recovery not possible ({d.why})")
            elif isinstance(d, ReplaceNode):
                self._replace_node(d)
            elif isinstance(d, (Replace, Shrink)):
                self._replace_lost(d, procs, codes)
            elif isinstance(d, KillSurvivors):
                self._kill_survivors_of_failure(procs, codes)
            elif isinstance(d, Collect):
                result = self.poll_workers()
                self.worker_group.state = result.state
                return self._carry_out(self._collected(result), result=result)
            elif isinstance(d, Restart):
                self._restart(d.reason)
            elif isinstance(d, MembershipRestart):
                self.events.emit(
                    "membership_restart", nodes_waiting=self.worker_group.spec.rdzv_handler.num_nodes_waiting()
                )
                console.say("the ranks stopped with a checkpoint: restarting the group with the new membership")
                self.stop_group()
                self.worker_group.state = WorkerState.STOPPED
                self._start_group()
            elif isinstance(d, Forward):
                self._forward(getattr(signal, d.signal))
            elif isinstance(d, CheckpointFirst):
                self._checkpoint_for_membership(d.count)
            elif isinstance(d, Admit):
                why = self._admit_nodes(d.count)
                if why is not None:
                    return self._carry_out(self.machine.feed(AdmitFailed(why, self._progress())))
                if self.replacer.pending is None:  # the arriving nodes left before the round formed
                    self.machine.feed(Joined())
                    self.machine.feed(Settled())  # nothing changed: no step to wait for
            elif isinstance(d, GrowBack):
                self._grow_back(d.ranks)
            elif isinstance(d, End):
                return self._end(d, result)
        return None

    def _recovery_failed(self, why: str, codes: Optional[dict[int, Optional[int]]]) -> None:
        """A recovery in place did not lead to a completed step (the progress rule): say why once,
        with what a rank said of it (:meth:`Replacer.failed`, which stops the warm spares when a
        rank gave it up), the seconds since it began, the exit codes and the survivors' stacks,
        then ask the live ranks for the last completed step (the just-in-time save: only a state
        whose parameters did not move since that step's boundary, and only where every answer holds
        the same model) and SIGKILL them: not a SIGTERM, which would ask for a checkpoint of the
        state after the failed recovery and wait ``kill_grace`` for ranks stuck in a collective.
        The group restart follows, from that step or the newest checkpoint."""
        said = self.replacer.failed() if self.replacer is not None else None
        seconds = self.replacer.recovery_seconds() if self.replacer is not None else None
        lost = {r: c for r, c in (codes or {}).items() if failed(c)}
        self.events.emit(
            "recovery_failed",
            reason=why,
            rank_said=said,
            seconds=None if seconds is None else round(seconds, 4),
            exit_codes=lost,
            stacks=self._dump_survivors("recovery"),
        )
        console.say(f"in-process recovery failed ({why}{'; ' + said if said else ''}): the group restarts")
        self._save_just_in_time()
        self._kill_live(self.worker_processes())

    def _collected(self, result: RunResult) -> Decisions:
        """Torch's result after **Collect**, as the next event's decisions."""
        if result.state == WorkerState.SUCCEEDED:
            if self.nodes is not None:
                self.nodes.finished()  # spare nodes still waiting may go
            if not (self.nodes and self.nodes.replaced):  # else the round holds a lost node: torch's barrier would wait
                self.exit_barrier()
            return self.machine.feed(Finished())
        if result.state not in (WorkerState.UNHEALTHY, WorkerState.FAILED):
            return ()
        codes = {r: f.exitcode for r, f in result.failures.items()}
        stopped = sorted(r for r, f in result.failures.items() if f.local_rank in self._stopped_by_us)
        self._stopped_by_us.clear()
        self.events.emit(
            "workers_failed",
            exit_codes=codes,
            pids={r: f.pid for r, f in result.failures.items()},
            stopped_by_launcher=stopped,
        )
        self.script_error = self._script_error(result) if not any(c in DECISION_CODES for c in codes.values()) else None
        error = self.script_error
        return self.machine.feed(Collected(codes, (error.exit_code, error.reason) if error else None, self._progress()))

    def _end(self, d: End, result: Optional[RunResult]) -> RunResult:
        """End the launch as **End** ``d`` says (the group stopped first unless it finished)."""
        if d.code != int(ExitCode.OK):
            self.stop_group()
        if d.kind == "give_up":
            self.events.emit("give_up", reason=d.cause, failure=d.reason[len(d.cause) + 2 :])
        elif d.kind == "restart_budget_spent":
            self.events.emit("restart_budget_spent", max_restarts=self.worker_group.spec.max_restarts, reason=d.reason)
        elif d.kind == "script_error" and self.script_error is not None:
            e = self.script_error
            self.events.emit("script_error", rank=e.rank, exit_code=e.exit_code, traceback=list(e.lines))
        else:
            self.script_error = None
        self.exit_code, self.exit_reason = d.code, d.reason
        return result if result is not None else RunResult(state=WorkerState.FAILED)

    def _replace_lost(
        self, d: Replace | Shrink, procs: dict[int, subprocess.Popen], codes: dict[int, Optional[int]]
    ) -> None:
        """In-process recovery: replace the lost ranks of ``d`` while the others run (see
        :mod:`.replace`), or go on without them (**Shrink**)."""
        lost = list(d.ranks)
        self.events.emit("workers_failed", exit_codes={r: codes[r] for r in lost}, pids={r: procs[r].pid for r in lost})
        orphans = [r for r in lost if deathsig.end_orphans(procs[r].pid)]  # their children hold their sockets
        if orphans:
            self.events.emit("orphans_ended", ranks=orphans, pids={r: procs[r].pid for r in orphans})
        workers = {w.local_rank: w for w in self.workers()}
        world_size = workers[lost[0]].world_size
        if isinstance(d, Shrink):
            self._shrink(lost, workers, world_size, [codes[r] for r in lost])
            return
        console.say(
            f"rank(s) {[workers[r].global_rank for r in lost]} lost (exit codes {[codes[r] for r in lost]}): "
            "replacing in-process, the other ranks keep running"
        )
        started = self.replacer.replace({workers[r].global_rank: self.worker_command(r) for r in lost}, world_size)
        for r in lost:
            self.replace_process(r, started[workers[r].global_rank])
            if self.monitor is not None:
                self.monitor.rank_replaced(r)
        if self.record is not None:
            self.record.write_ranks(self.worker_pids())

    def _dump_survivors(self, tag: str) -> list[str]:
        """The Python stacks of every live rank of this node (why did a recovery not complete?),
        as paths under ``RUN_DIR/stacks``; none without the hang supervisor. A rank that exited or
        that the hang supervisor killed is skipped (its dump would only wait ``stacks_wait`` for
        nothing; a hung rank's stacks were taken before its kill)."""
        if self.monitor is None:
            return []
        procs = self.worker_processes()
        live = [w for w in self.workers() if w.local_rank in procs and procs[w.local_rank].poll() is None]
        paths = [
            self.monitor.dump_stacks(w.local_rank, w.global_rank, procs[w.local_rank].pid, tag)
            for w in live
            if not self.monitor.killed(procs[w.local_rank].pid)
        ]
        return [str(p) for p in paths if p is not None]

    def _kill_survivors_of_failure(self, procs: dict[int, subprocess.Popen], codes: dict[int, Optional[int]]) -> None:
        """If a rank has exited with a failure (not 0 or a decision code) in this poll's ``codes``,
        SIGCONT and SIGKILL the ranks still running in it (``procs``); torch then collects the group."""
        if any(failed(c) for c in codes.values()):
            self._save_just_in_time()
            self._kill_live({r: p for r, p in procs.items() if codes[r] is None})

    def _save_just_in_time(self) -> None:
        """Before the group restarts: the ranks save the last completed step from memory, the
        agent stops them and makes the missing copies (:mod:`.jit`); once per attempt."""
        attempt = self.restart_count
        if self.jit is None or not self.jit.request(attempt):
            return
        procs = self.worker_processes()
        ranks = {w.local_rank: w.global_rank for w in self.workers()}
        self.jit.wait(attempt, procs, ranks)
        self._kill_live(procs)  # nothing writes a copy from here on
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=JIT_EXIT_WAIT)
        self.jit.compose(attempt, ranks, self.workers()[0].world_size)

    def _kill_live(self, procs: dict[int, subprocess.Popen]) -> None:
        """SIGCONT and SIGKILL the ranks of ``procs`` that still run (noted as stopped by the launcher)."""
        for r, p in procs.items():
            if p.poll() is None:
                self._stopped_by_us.add(r)
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, sig)

    def _script_error(self, result: RunResult) -> Optional[ScriptError]:
        """The failure is an error of the script before its first step or after its training loop
        (see :mod:`.script_error`)."""
        if self.monitor is None:  # without heartbeat records "before the first step" is unknown
            return None
        workers = {w.local_rank: w.global_rank for w in self.workers()}
        done = self.monitor.steps_done()
        failed = {r: f for r, f in result.failures.items() if f.exitcode != 0}
        return script_error.decide(
            self.restart_count == 0,
            {r: f.exitcode for r, f in failed.items()},
            {workers.get(lr, lr): n for lr, n in done.items()},
            {r: script_error.read_tail(self.worker_stderr(f.local_rank)) for r, f in failed.items()},
            frozenset(workers.get(lr, lr) for lr in self.monitor.finished_training()),
        )

    def _restart(self, reason: str) -> None:
        """**Restart**: stop the group and start it again (the state machine counted the restart)."""
        self._save_just_in_time()  # (a hang's restart: the survivors are still running)
        jit_step = self.jit.saved.get(self.restart_count) if self.jit is not None else None
        self.use_restart()
        if self.replacer is not None:
            self.replacer.abandon()
        self.events.emit("group_restart", reason=reason, remaining_restarts=self.remaining_restarts)
        newest = self.monitor.newest_checkpoint() if self.monitor else None
        if jit_step is not None and (newest is None or jit_step > newest):
            start = f"the just-in-time copy of step {jit_step}"
            if self.worker_group.group_world_size > 1:  # each node makes its ranks' copies
                start += " where every node made one (else the newest checkpoint)"
        else:
            start = f"the checkpoint of step {newest}" if newest is not None else "the newest checkpoint"
        console.say(f"restarting the group ({reason}) from " + start + f"; {self.remaining_restarts} restart(s) left")
        self.stop_group()
        self.worker_group.state = WorkerState.STOPPED
        self._start_group()
