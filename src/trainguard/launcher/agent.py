"""The per-node elastic agent behind ``trainguard run``.

It is torch's ``LocalElasticAgent`` (rendezvous, worker start/stop, restarts) with trainguard's
monitor loop in place of ``_invoke_run``:

* a worker group that fails because a rank died or crashed is restarted (``max_restarts``,
  default 3) and resumes from the newest valid checkpoint; the surviving ranks are SIGKILLed at
  once (after SIGCONT, for a stopped one): they cannot finish a collective or a save without the
  dead peer, and torch's own close would SIGTERM them and wait up to 30 s;
* with in-process recovery (``replacer``, :mod:`.replace`), a rank that dies while the others run
  (or that the hang supervisor killed) is replaced by a new process and the survivors keep running; a second failure while that
  generation forms, a spent replacement budget or a generation that does not form in time fall
  back to the group restart above (``recovery_fallback``);
* a rank that exits with a *decision* code is not restarted: 75 (requeue: the ranks stopped and
  saved), 2 (bad input), 76 (give up) end the launch with that code;
* SIGTERM, SIGUSR1 and SIGINT to the launcher are forwarded to every local rank, which saves and
  exits with 75; ranks still alive ``stop_grace`` seconds later are killed;
* every decision is an event in ``RUN_DIR/events.jsonl`` (rank ``null``).

``poll_hooks`` is the extension point for the hang supervisor: callables run every monitor
interval that may return a reason to restart the group (for example a missed heartbeat).

What it needs of torch's agent beyond ``run()`` comes through :mod:`trainguard.launcher.elastic`
(the only module that touches torch elastic's private members).
"""

from __future__ import annotations

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
from ..launch_env import JOIN, RECOVERY_GROUP, RECOVERY_STORE
from ..supervisor.monitor import HangMonitor
from . import script_error
from .elastic import ElasticAdapter
from .membership import MembershipChanges
from .node_join import NodeJoin
from .record import LaunchRecord
from .replace import Replacer, replacement_command
from .script_error import ScriptError

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# exit codes with which a rank tells the launcher "do not restart, end the launch with this code"
DECISION_CODES = (int(ExitCode.REQUEUE), int(ExitCode.BAD_INPUT), int(ExitCode.GIVE_UP))


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
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.events = events
        self.stop_grace = stop_grace
        self.kill_grace = kill_grace
        self.monitor = monitor
        self.record = record
        self.replacer = replacer
        self.exit_code = int(ExitCode.GIVE_UP)
        self.exit_reason = "not started"
        self.stop_signal: Optional[str] = None
        self.script_error: Optional[ScriptError] = None  # the launch ended on an error of the script
        self._stop_deadline: Optional[float] = None
        self._forwarded_to: set[int] = set()
        self._regrowing = False  # the ranks were asked to checkpoint and stop for a membership change
        self._withdrawn: list[int] = []  # local ranks the group went on without (a shrink), until it grows back
        self._stopped_by_us: set[int] = set()  # local ranks SIGKILLed because a peer failed
        self._join: Optional[NodeJoin] = None  # this start joined another node's running group
        self.poll_hooks: list[Callable[[TrainguardAgent], Optional[str]]] = [monitor.poll] if monitor else []

    # ---- signals -------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """Handle SIGTERM/SIGUSR1/SIGINT in the launcher (torch elastic keeps SIGHUP/SIGQUIT)."""
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = signal.Signals(signum).name
            self._stop_deadline = time.monotonic() + self.stop_grace
        self._forward(signum)

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
        os.environ.update({RECOVERY_STORE: address, RECOVERY_GROUP: str(number)})
        self._join = join
        if join is not None:
            gen = join.generation
            argv = replacement_command([group.spec.entrypoint, *group.spec.args], self.replacer.script)
            self.start_as(join.ranks, gen.world_size, (gen.host, gen.port), argv)
            os.environ[JOIN] = str(gen.number)

    def _start_group(self) -> None:
        self._forwarded_to, self._regrowing, self._withdrawn = set(), False, []
        if self.monitor is not None:
            self.monitor.group_started(self.restart_count)
        try:
            self.start_workers()
        finally:
            self.restore_args()  # a node that joined a running group: the launch's own command next time
            os.environ.pop(JOIN, None)
        if self.replacer is not None:
            self.replacer.fill_spares(*self.worker_command(0))
        group = self.worker_group
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
        """Start the group, then poll it every ``monitor_interval`` until the launch ends: restart it
        after a failure or a hang (within the budget and the give-up rules), end on success, on a
        decision exit code, or when the ranks do not stop within ``stop_grace`` of a signal."""
        spec = self.worker_group.spec
        self._start_group()
        while True:
            time.sleep(spec.monitor_interval)
            if self.replacer is not None:
                for gen in self.replacer.follow():
                    self._follow(gen)
            procs = self.worker_processes()
            codes = {r: p.poll() for r, p in procs.items()}  # one look per poll, for every check below
            why = self._replace_lost(procs, codes) if self.replacer is not None else None
            if why is not None:
                if self._restart_or_give_up(f"in-process recovery failed: {why}"):
                    continue
                return RunResult(state=WorkerState.FAILED)
            now = self.worker_processes()  # a rank replaced just now counts as running in this poll
            codes = {r: None if now[r] is not procs[r] else c for r, c in codes.items()}
            self._kill_survivors_of_failure(now, codes)
            # torch's own poll closes every survivor on a failure it sees: it runs only when this
            # poll's one look has already decided the group's fate (a rank that dies after the look
            # is the next poll's, and can still be replaced in-process)
            result = self.poll_workers() if needs_torch_poll(codes) else RunResult(state=WorkerState.HEALTHY)
            self.worker_group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self.exit_barrier()
                self.exit_code, self.exit_reason = int(ExitCode.OK), "finished"
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                if self._handle_failure(result):
                    continue
                return result
            if self.stop_signal and self._stop_deadline and time.monotonic() > self._stop_deadline:
                self.events.emit("stop_grace_expired", signal=self.stop_signal, grace=self.stop_grace)
                self.stop_group()
                self.exit_code, self.exit_reason = int(ExitCode.REQUEUE), "stop grace expired"
                return RunResult(state=WorkerState.FAILED)
            reason = next((r for hook in self.poll_hooks if (r := hook(self))), None)
            if reason is not None:
                self.events.emit("group_unhealthy", reason=reason)
                unkillable = self.monitor is not None and self.monitor.unkillable
                if self.replacer is not None and self.replacer.can_replace() is None and not unkillable:
                    continue  # the supervisor SIGKILLed the hung ranks: the next poll replaces them in-process
                if not self._restart_or_give_up(reason):
                    return RunResult(state=WorkerState.FAILED)
            elif not self._regrowing and (waiting := spec.rdzv_handler.num_nodes_waiting()) > 0:  # not a failure
                if self.replacer is None or not self.replacer.can_admit():
                    self._checkpoint_for_membership(waiting)
                elif self.replacer.abandoned():  # the node that waits restarted its part of this group
                    if not self._restart_or_give_up("the group restarted on another node"):
                        return RunResult(state=WorkerState.FAILED)
                elif self.replacer.pending is None and self.stop_signal is None:
                    why = self._admit_nodes(waiting)
                    if why is not None and not self._restart_or_give_up(why):
                        return RunResult(state=WorkerState.FAILED)
            elif self._withdrawn and self.stop_signal is None and not self._regrowing and self.replacer.can_grow():
                self._grow_back()

    def _replace_lost(self, procs: dict[int, subprocess.Popen], codes: dict[int, Optional[int]]) -> Optional[str]:
        """In-process recovery: replace the ranks that exited with a failure while the others run
        (see :mod:`.replace`). ``procs``/``codes``: this poll's ``{local_rank: Popen}`` and exit codes
        (``None`` while running). Returns why recovery failed (the group must restart), else ``None``
        (nothing lost, replaced, or left to the group restart of the normal failure path)."""
        why = self.replacer.poll()
        if why is not None:
            stacks = self._dump_survivors("recovery")
            self.events.emit("recovery_fallback", reason=why, stacks=stacks)
            console.say(f"in-process recovery failed ({why}): restarting the group")
            return why
        lost = [r for r, c in codes.items() if _failed(c)]
        if not lost or self.stop_signal is not None or any(c in DECISION_CODES for c in codes.values()):
            return None
        workers = {w.local_rank: w for w in self.workers()}
        why = self.replacer.can_replace()
        if why is None and len(lost) == len(codes) == workers[lost[0]].world_size:
            why = "no rank survived to send the state"
        if why is not None:  # the normal failure path below restarts the group
            self.events.emit("recovery_fallback", reason=why, exit_codes={r: codes[r] for r in lost})
            console.say(f"in-process recovery not possible ({why}): restarting the group")
            return None
        self.events.emit("workers_failed", exit_codes={r: codes[r] for r in lost}, pids={r: procs[r].pid for r in lost})
        world_size = workers[lost[0]].world_size
        if self.worker_group.group_world_size == 1 and self.replacer.can_shrink(len(lost), world_size):
            self._shrink(lost, workers, world_size, [codes[r] for r in lost])
            return None
        console.say(
            f"rank(s) {[workers[r].global_rank for r in lost]} lost (exit codes {[codes[r] for r in lost]}): "
            "replacing in-process, the other ranks keep running"
        )
        started = self.replacer.replace(
            {workers[r].global_rank: self.worker_command(r) for r in lost}, workers[lost[0]].world_size
        )
        for r in lost:
            self.replace_process(r, started[workers[r].global_rank])
            if self.monitor is not None:
                self.monitor.rank_replaced(r)
        if self.record is not None:
            self.record.write_ranks(self.worker_pids())
        return None

    def _dump_survivors(self, tag: str) -> list[str]:
        """The Python stacks of every live rank of this node (why did a recovery not complete?),
        as paths under ``RUN_DIR/stacks``; none without the hang supervisor."""
        if self.monitor is None:
            return []
        pids = self.worker_pids()
        paths = [
            self.monitor.dump_stacks(w.local_rank, w.global_rank, pids.get(w.local_rank), tag) for w in self.workers()
        ]
        return [str(p) for p in paths if p is not None]

    def _kill_survivors_of_failure(self, procs: dict[int, subprocess.Popen], codes: dict[int, Optional[int]]) -> None:
        """If a rank has exited with a failure (not 0 or a decision code) in this poll's ``codes``,
        SIGCONT and SIGKILL the ranks still running in it (``procs``); torch then collects the group."""
        if not any(_failed(c) for c in codes.values()):
            return
        for r, p in procs.items():
            if codes[r] is None:
                self._stopped_by_us.add(r)
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass

    def _handle_failure(self, result: RunResult) -> bool:
        """Record the failure and restart the group if that is the right move; True if restarted."""
        codes = {r: f.exitcode for r, f in result.failures.items()}
        stopped = sorted(r for r, f in result.failures.items() if f.local_rank in self._stopped_by_us)
        self._stopped_by_us.clear()
        self.events.emit(
            "workers_failed",
            exit_codes=codes,
            pids={r: f.pid for r, f in result.failures.items()},
            stopped_by_launcher=stopped,
        )
        decision = next((c for c in DECISION_CODES if c in codes.values()), None)
        if self._regrowing and decision == int(ExitCode.REQUEUE) and self.stop_signal is None:
            self.events.emit(
                "membership_restart", nodes_waiting=self.worker_group.spec.rdzv_handler.num_nodes_waiting()
            )
            console.say("the ranks stopped with a checkpoint: restarting the group with the new membership")
            self.stop_group()
            self.worker_group.state = WorkerState.STOPPED
            self._start_group()
            return True
        if decision is not None or self.stop_signal is not None:
            self.stop_group()
            self.exit_code = decision if decision is not None else int(ExitCode.REQUEUE)
            self.exit_reason = {75: "ranks stopped for requeue", 2: "bad input", 76: "a rank gave up"}[self.exit_code]
            return False
        error = self._script_error(result)
        if error is not None:
            self.stop_group()
            self.events.emit("script_error", rank=error.rank, exit_code=error.exit_code, traceback=list(error.lines))
            self.exit_code, self.exit_reason = error.exit_code, error.reason
            self.script_error = error
            return False
        return self._restart_or_give_up(f"rank failure (exit codes {codes})")

    def _script_error(self, result: RunResult) -> Optional[ScriptError]:
        """The failure is an error of the script before its first step (see :mod:`.script_error`)."""
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
        )

    def _restart_or_give_up(self, reason: str) -> bool:
        spec = self.worker_group.spec
        why = (
            self.monitor.policy.give_up_reason(self.monitor.failure_step(), self.monitor.newest_checkpoint())
            if self.monitor
            else None
        )
        if why is not None:
            self.stop_group()
            self.events.emit("give_up", reason=why, failure=reason)
            self.exit_code, self.exit_reason = int(ExitCode.GIVE_UP), f"{why}: {reason}"
            return False
        if self.remaining_restarts <= 0:
            self.stop_group()
            self.events.emit("restart_budget_spent", max_restarts=spec.max_restarts, reason=reason)
            self.exit_code, self.exit_reason = (
                int(ExitCode.GIVE_UP),
                f"restart budget ({spec.max_restarts}) spent: {reason}",
            )
            return False
        self.use_restart()
        if self.replacer is not None:
            self.replacer.abandon()
        self.events.emit("group_restart", reason=reason, remaining_restarts=self.remaining_restarts)
        newest = self.monitor.newest_checkpoint() if self.monitor else None
        console.say(
            f"restarting the group ({reason}) from "
            + (f"the checkpoint of step {newest}" if newest is not None else "the newest checkpoint")
            + f"; {self.remaining_restarts} restart(s) left"
        )
        self.stop_group()
        self.worker_group.state = WorkerState.STOPPED
        self._start_group()
        return True


def needs_torch_poll(codes: dict[int, Optional[int]]) -> bool:
    """Whether torch's poll (which collects the exit codes, and closes every survivor when it sees
    a failure) runs after this poll's look ``codes`` (``{local_rank: exit code, None while
    running}``, a replaced rank counted as running): only once every rank has exited, or one has
    exited with anything but 0 (a failure the look saw, whose survivors the agent already killed, or
    a decision code)."""
    return all(c is not None for c in codes.values()) or any(c not in (None, 0) for c in codes.values())


def _failed(code: Optional[int]) -> bool:
    """A worker's exit code is a failure: it has exited, neither with 0 nor with a decision code."""
    return code is not None and code not in (0, *DECISION_CODES)
