"""The launcher side of hang detection: read the ranks' records, time their sections, act on a hang.

Every poll (``[launcher] monitor_interval``, 0.1 s) the monitor reads each local rank's heartbeat
record (a memory read, no system call) and compares how long the rank has been in its current
section (or out of any section, or, before its first heartbeat, since the group started) with the
timeout in force for it (:class:`~trainguard.supervisor.timeouts.TimeoutBook`). A silent rank whose
process the monitor has seen stopped (state ``T``: SIGSTOP) for ``[supervisor] stopped_grace``
(0.3 s) is hung at once, without waiting for that timeout (:class:`.evidence.StopWatch`). A rank
over its timeout whose main thread keeps computing is *busy*, not hung (:mod:`.evidence`): a
``slow_section`` event and one console line, and neither it nor the ranks waiting for it are
touched (a waiting rank's silence counts from the last poll that saw it waiting: when the busy
rank moves on, the collective completes on it a moment later); unless it is stuck in place: its
main thread's stack, dumped once per timeout, stayed the same for ``[supervisor] spin_factor``
(5) × its timeout (a loop that never ends; real work moves between lines over five of its own
timeouts). With several nodes a busy rank's node says so to the others through the shared
recovery store (:meth:`HangMonitor.share_busy`): their silent ranks are
waiting for it in a collective, not hung. Any other rank over its timeout is hung:

1. its Python stacks (all threads) are dumped: SIGUSR2 makes the rank's ``faulthandler`` write
   them (SIGCONT first wakes a stopped process) and the file is copied to
   ``RUN_DIR/stacks/attempt<A>-rank<R>.txt``;
2. a ``hang_detected`` event names the rank, section, step, silence and timeout;
3. the hung ranks are SIGKILLed (a stuck main thread never runs a SIGTERM handler), the agent
   stops the rest of the group (SIGTERM, ``kill_grace``, SIGKILL: the peers of a killed rank
   usually fail out of their collective at once) and restarts it, within the budget.

:class:`~trainguard.launcher.membership.GiveUpRule` adds the give-up rules besides the budget: ``max_no_progress_restarts``
consecutive restarts without a new checkpoint, or ``max_same_step_faults`` failures in a row at the
same step (a deterministic fault that a restart cannot cure).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

import psutil

from .. import console
from ..checkpoint.store import CheckpointStore
from ..config import Config
from ..events import EventLog
from .advice import is_stopped, section_advice
from .evidence import LOOK_AFTER, CpuMeter, StopWatch
from .heartbeat import OUT_OF_SECTION, HeartbeatReader, RankState, heartbeat_path
from .peers import WORD_GRACE, BusyPeers
from .stacks import dump_stacks, main_stack, stack_path
from .timeouts import INITIAL, TEARDOWN, TimeoutBook


def attempt_dir(root: str | os.PathLike, attempt: int) -> Path:
    """Heartbeat directory of one worker-group attempt (restart count)."""
    return Path(root) / f"attempt-{attempt}"


class Spin(NamedTuple):
    """What the spin check (:meth:`HangMonitor._stuck`) last saw of a busy rank's silence."""

    started: float  # monotonic start of the silence
    stack: str  # the main thread's stack in the newest dump
    since: float  # monotonic time of the first dump with that stack
    last: float  # monotonic time of the newest dump


class HangHit(NamedTuple):
    """One rank found over its timeout by a poll."""

    worker: Any  # torch elastic's Worker: local_rank, global_rank
    section: str  # the section it is in (``out_of_section`` between sections, ``initial`` before any record)
    silent: float  # seconds it has been in that section (or out of any, or since the group started)
    limit: float  # the timeout in force for that section, seconds
    step: Optional[int]  # the last step it reported; None before its first heartbeat
    stopped: float = 0.0  # seconds the monitor has seen its process stopped (state T), when that made it hung


def stuck_first(hung: list[HangHit], pids: dict[int, int]) -> list[HangHit]:
    """Of ranks silent in the same step, the stopped ones (SIGSTOP, a debugger) or those in
    uninterruptible I/O, when there are such and others: the others sleep in a collective,
    waiting for them. Without such a difference every rank in ``hung`` stays hung.

    Args:
        pids: ``{local_rank: pid}`` of the workers.
    """
    frozen = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_DISK_SLEEP}

    def status(h: HangHit) -> Optional[str]:
        try:
            return psutil.Process(pids[h.worker.local_rank]).status()
        except (KeyError, psutil.Error):
            return None

    stuck = [h for h in hung if status(h) in frozen]
    return stuck if stuck and len(stuck) < len(hung) else hung


def unkillable(killed: dict[int, float], alive: set[int], now: float, grace: float) -> list[int]:
    """The processes SIGKILLed at least ``grace`` seconds ago (``killed``: ``{pid: monotonic time
    of the SIGKILL}``) that are still ``alive`` at ``now``: in uninterruptible sleep (a hung NFS
    mount, a wedged driver), beyond any signal. Sorted by pid."""
    return sorted(pid for pid, at in killed.items() if pid in alive and now - at >= grace)


class HangMonitor:
    """Watches one node's ranks for hangs and keeps the learned timeouts.

    Args:
        cfg: the launch's config (``[supervisor]``, ``[checkpoint]`` are used).
        run_dir: the run directory (``timeouts.json``, ``stacks/``, checkpoints).
        hb_root: node-local directory of the heartbeat records (``TRAINGUARD_HEARTBEAT_DIR``).
        events: the launcher's event log.
        write_timeouts: whether this node writes ``timeouts.json`` (node 0 of a multi-node job).
    """

    SAVE_EVERY = 30.0  # seconds between writes of timeouts.json during a run

    def __init__(self, cfg: Config, run_dir: Path, hb_root: Path, events: EventLog, write_timeouts: bool = True):
        self.cfg, self.run_dir, self.hb_root, self.events = cfg.supervisor, run_dir, hb_root, events
        self.book = TimeoutBook.load(cfg.supervisor, run_dir)
        self.write_timeouts = write_timeouts
        root = Path(cfg.checkpoint.dir)
        self.store = CheckpointStore(root if root.is_absolute() else run_dir / root)
        self.attempt = 0
        self._readers: dict[int, HeartbeatReader] = {}
        self._last_states: dict[int, RankState] = {}
        self._started = time.monotonic()
        self._last_learn = self._last_save = 0.0
        self._frozen = False  # set on a hang: the attempt's observations stop at the detection
        self._replaced_at: dict[int, float] = {}  # local rank -> when a replacement was started
        self._withdrawn: set[int] = set()  # local ranks the group went on without (a shrink)
        self.cpu = CpuMeter()
        self.stopped = StopWatch()
        self._slow: dict[int, float] = {}  # local rank -> start of the silence last reported as slow_section
        # local rank -> the last poll that found it waiting for a busy rank: its silence counts from then
        self._waited_until: dict[int, float] = {}
        self._spin: dict[int, Spin] = {}  # local rank -> its busy silence's stack dumps (see _stuck)
        self._save_failed = False  # the last write of timeouts.json failed (warned once)
        self._killed: dict[int, float] = {}  # pid -> monotonic time this monitor SIGKILLed it (a hung rank)
        self.unkillable: list[int] = []  # pids that outlived their SIGKILL by kill_grace (the group must restart)
        self._peers: Optional[BusyPeers] = None  # the other nodes' supervisors (share_busy)
        self._waited: Optional[int] = None  # the node whose busy rank this node's silent ranks wait for (said once)

    # ---- group lifecycle (called by the agent) ------------------------------------------------

    def share_busy(self, store: Any, node: int, nodes: int) -> None:
        """Several nodes: tell the others through ``store`` (a
        :class:`~trainguard.rejoin.protocol.RecoveryStore`, sealed) when a rank of this node
        (``node`` of ``nodes``) is slow, not hung, and hear when one of theirs is: this node's
        silent ranks are then waiting for it in a collective, not hung (each supervisor sees only
        its own node's ranks)."""
        self._peers = BusyPeers(store, node, nodes)

    def group_started(self, attempt: int) -> None:
        """A new worker group (``attempt`` = restart count) was started."""
        self._close_readers()
        self.attempt = attempt
        # a membership-change restart keeps the restart count: clear the old group's records so
        # that a fresh worker is never judged by its predecessor's silence
        shutil.rmtree(attempt_dir(self.hb_root, attempt), ignore_errors=True)
        self._started = time.monotonic()
        self._frozen = False
        self._replaced_at, self._withdrawn = {}, set()
        self.cpu, self.stopped, self._slow, self._spin = CpuMeter(), StopWatch(), {}, {}
        self._waited_until = {}
        self._killed, self.unkillable = {}, []

    def rank_replaced(self, local_rank: int) -> None:
        """A lost rank was replaced in-process (:mod:`trainguard.launcher.replace`): forget its
        record; its replacement is timed as a starting rank (the initial timeout, from now) until
        it writes its own."""
        reader = self._readers.pop(local_rank, None)
        if reader is not None:
            reader.close()
        self._last_states.pop(local_rank, None)
        heartbeat_path(attempt_dir(self.hb_root, self.attempt), local_rank).unlink(missing_ok=True)
        self._replaced_at[local_rank] = time.monotonic()

    def rank_withdrawn(self, local_rank: int) -> None:
        """The group went on without the rank of ``local_rank`` (a shrink): it is not watched any
        more until the next group start."""
        self.rank_replaced(local_rank)
        self._withdrawn.add(local_rank)

    def rank_returned(self, local_rank: int) -> None:
        """A withdrawn slot takes part again (the group grew back in place): it is watched as a
        starting rank, as a replacement is."""
        self._withdrawn.discard(local_rank)
        self.rank_replaced(local_rank)

    def group_stopped(self) -> None:
        """The group ended or is being restarted: fold its observations in, save timeouts.json."""
        self._learn()
        self.book.close_attempt()
        self._close_readers()
        self.save_timeouts()

    def failure_step(self) -> Optional[int]:
        """The step the group failed in: one past the fewest steps a local rank completed, read now
        (a dead or hung rank stopped at a fixed step; its peers may or may not have completed one
        more by the time the failure is seen). None if no rank reported."""
        for local_rank, reader in self._readers.items():
            state = reader.state()
            if state is not None:
                self._last_states[local_rank] = state
        steps = [s.step for s in self._last_states.values()]
        return min(steps) + 1 if steps else None

    def _states(self) -> dict[int, Optional[RankState]]:
        """``{local_rank: its record now}`` (the last consistent one mid-write; ``None``: none)."""
        states: dict[int, Optional[RankState]] = {}
        for local_rank in set(self._readers) | set(self._last_states):
            reader = self._readers.get(local_rank)
            states[local_rank] = (reader.state() if reader is not None else None) or self._last_states.get(local_rank)
        return states

    def steps_done(self) -> dict[int, Optional[int]]:
        """``{local_rank: steps its current process completed}`` (heartbeats since it started;
        ``None``: no record, it never created its Guard), read now."""
        # the record starts with one beat
        return {r: (s.beats - 1 if s is not None else None) for r, s in self._states().items()}

    def finished_training(self) -> frozenset[int]:
        """Local ranks whose current process left training (its record is in the teardown
        section: after the ``end`` event, or an outcome), read now."""
        return frozenset(r for r, s in self._states().items() if s is not None and s.section == TEARDOWN)

    def ending(self, besides: frozenset[int] = frozenset()) -> bool:
        """Whether a local rank other than those of ``besides`` (the failed ones: a rank that leaves
        alone, SDC's exclusion, tears down too) has left training: its record is in the teardown
        section (after the ``end`` event, or an outcome every rank carries out), read now."""
        states = self._states().items()
        return any(s is not None and s.section == TEARDOWN for r, s in states if r not in besides)

    def newest_checkpoint(self) -> Optional[int]:
        """Step of the newest committed checkpoint directory (by name)."""
        committed = self.store.committed()
        return committed[-1].step if committed else None

    def save_timeouts(self) -> None:
        """Write ``timeouts.json`` (only on the node that owns it). A write the file system refuses
        (a full disk) is not raised: one warning, and the next save tries again; the file keeps
        its previous content (it is replaced atomically)."""
        if not self.write_timeouts:
            return
        try:
            self.book.save(self.run_dir)
        except OSError as e:
            if not self._save_failed:
                console.warn(
                    f"timeouts.json could not be written ({e.strerror or e}): the learned timeouts are kept in memory"
                )
            self._save_failed = True
        else:
            self._save_failed = False
        self._last_save = time.monotonic()

    # ---- polling --------------------------------------------------------------------------------

    def poll(self, agent: Any) -> Optional[str]:
        """One check of every local rank of ``agent`` (its ``workers()`` and ``worker_pids()``, see
        :class:`~trainguard.launcher.torch_agent.ElasticAdapter`); returns a restart reason if some are hung."""
        if not self.cfg.enabled:
            return None
        now = time.monotonic()
        pids = agent.worker_pids()
        for pid in pids.values():
            self.cpu.sample(pid, now)
        watched = [w for w in agent.workers() if w.local_rank not in self._withdrawn]
        hung = [hit for w in watched if (hit := self._check(w, pids.get(w.local_rank), now)) is not None]
        # A rank over its timeout while a local peer that is not ahead of it is still within its own
        # timeout is waiting for that peer (rank-local work such as an evaluation): not hung. A
        # stopped rank waits for no one.
        over = {h.worker.local_rank for h in hung}
        hung = [
            h
            for h in hung
            if h.step is None
            or h.stopped
            or not any(
                q != h.worker.local_rank and q not in over and st.step <= h.step for q, st in self._last_states.items()
            )
        ]
        # Of ranks over their timeouts at different steps, those ahead completed steps the laggards
        # did not: they wait for them inside a collective. Only the laggards are hung (in-process
        # recovery replaces just them; a group restart stops every rank anyway).
        low = min((h.step for h in hung if h.step is not None), default=None)
        hung = [h for h in hung if h.step is None or h.step == low]
        hung = stuck_first(hung, pids)
        hung.sort(key=lambda h: (h.step if h.step is not None else -1, -h.silent))  # the laggard first
        # a rank killed by an earlier poll is dying, not hung again: no second dump, kill or event
        dying = [h for h in hung if pids.get(h.worker.local_rank) in self._killed]
        hung = [h for h in hung if h not in dying]
        if now - self._last_learn > 1.0:
            self._learn()
        if now - self._last_save > self.SAVE_EVERY:
            self.save_timeouts()
        if dying and (stuck := self._unkillable(dying, pids, now)):
            return stuck
        if not hung:
            return None
        # a silent rank whose main thread computes is slow, not hung; the others wait for it
        busy = [
            h
            for h in hung
            if not h.stopped
            and h.silent < self.cfg.busy_timeout
            and self.cpu.busy(pids.get(h.worker.local_rank))
            and not self._stuck(h, pids.get(h.worker.local_rank), now)
        ]
        if busy and self.cfg.busy_evidence:
            self._report_slow(busy, self._waiting(hung, busy, now), pids, now)
            self._tell_busy()
            return None
        if self.cfg.busy_evidence and self._waiting_elsewhere(hung):
            self._waiting(hung, [], now)
            return None
        if self.cfg.busy_evidence and self._word_may_come(hung):
            return None
        # a rank that waited for a busy one until lately is silent since then (that one's
        # collective is still completing on it): not hung before its own timeout from then
        hung = [
            h for h in hung if h.stopped or now - self._waited_until.get(h.worker.local_rank, float("-inf")) > h.limit
        ]
        if not hung:
            return None
        # learn from what the ranks recorded up to now, not from steps stalled by this hang
        self._learn()
        self._frozen = True
        detected_at = time.time()  # the events come after the stack dumps: they carry this poll's time
        working: list[Optional[Path]] = []  # the stacks of the ranks not stopped (read before the kill)
        for h in hung:
            if not h.stopped:  # a stopped rank says nothing about the section's length
                self.book.interrupted(h.section, h.silent)  # a restart gets twice as long there (timeouts)
            pid, stuck = pids.get(h.worker.local_rank), self._stuck_since(h, now)
            stacks = self.dump_stacks(h.worker.local_rank, h.worker.global_rank, pid)
            if not h.stopped and not is_stopped(pid):  # a stopped rank computes nothing: no advice on its work
                working.append(stacks)
            if pid is not None:  # unresponsive by definition: SIGTERM cannot reach a stuck main thread
                try:
                    os.kill(pid, signal.SIGKILL)
                    self._killed[pid] = time.monotonic()
                except ProcessLookupError:
                    pass
            self.events.emit(
                "hang_detected",
                h.step,
                **_hit_details(h, stacks),
                learned=self.book.learned(h.section) is not None,
                stuck_in_place=stuck,
                stopped_seconds=h.stopped or None,
                detected_at=round(detected_at, 3),
            )
            console.say(
                f"hang: rank {h.worker.global_rank} silent {h.silent:.1f} s in '{h.section}' at step {h.step} "
                + (f"(stopped, state T, for {h.stopped:.1f} s)" if h.stopped else f"(timeout {h.limit:.1f} s)")
                + (f", busy but its stack unchanged for {stuck:.1f} s: stuck in place" if stuck else "")
                + "; killed"
                + (f"; stacks in {stacks}" if stacks else "")
            )
        work = (
            f" (if it is work longer than a step, such as an evaluation: {section_advice(working[0])})"
            if working
            else ""
        )
        return (
            "; ".join(
                f"hang: rank {h.worker.global_rank} silent {h.silent:.1f} s in '{h.section}' "
                + (f"(stopped for {h.stopped:.1f} s)" if h.stopped else f"(timeout {h.limit:.1f} s)")
                for h in hung
            )
            + work
        )

    def _stuck(self, h: HangHit, pid: Optional[int], now: float) -> bool:
        """Whether busy rank ``h`` is stuck in place: its main thread's stack (dumped at most once
        per ``h.limit`` seconds of its silence) has been the same for ``spin_factor × h.limit``
        seconds. A busy rank whose stack cannot be dumped is not judged stuck (``busy_timeout``
        still bounds it)."""
        started, seen = now - h.silent, self._spin.get(h.worker.local_rank)
        if seen is not None and abs(seen.started - started) >= 1.0:
            seen = None  # another silence
        if seen is None or now - seen.last >= h.limit:
            path = self.dump_stacks(h.worker.local_rank, h.worker.global_rank, pid, "spin")
            stack = main_stack(path.read_text(errors="replace")) if path is not None else None
            if stack is None:
                return False
            seen = Spin(started, stack, now, now) if seen is None or seen.stack != stack else seen._replace(last=now)
            self._spin[h.worker.local_rank] = seen
        return now - seen.since >= self.cfg.spin_factor * h.limit

    def _stuck_since(self, h: HangHit, now: float) -> Optional[float]:
        """Seconds the main thread of hung rank ``h`` has been seen stuck in place, ``None`` if it was not."""
        seen = self._spin.get(h.worker.local_rank)
        if seen is None or abs(seen.started - (now - h.silent)) >= 1.0:
            return None
        return round(now - seen.since, 3)

    def _unkillable(self, dying: list[HangHit], pids: dict[int, int], now: float) -> Optional[str]:
        """The restart reason when a rank this monitor SIGKILLed is still there ``kill_grace``
        seconds later (:func:`unkillable`; a ``rank_unkillable`` event, once per process), else
        ``None`` (still within the grace: the next polls wait for its exit)."""
        alive = {pids[h.worker.local_rank] for h in dying if psutil.pid_exists(pids[h.worker.local_rank])}
        stuck = unkillable(self._killed, alive, now, self.cfg.kill_grace)
        if not stuck:
            return None
        parts = []
        for pid in stuck:
            hit = next(h for h in dying if pids[h.worker.local_rank] == pid)
            try:
                state = psutil.Process(pid).status()
            except psutil.Error:
                state = "gone"
            if pid not in self.unkillable:
                self.unkillable.append(pid)
                self.events.emit("rank_unkillable", hit.step, rank=hit.worker.global_rank, pid=pid, state=state)
            parts.append(
                f"rank {hit.worker.global_rank} (pid {pid}) did not exit {self.cfg.kill_grace:g} s after SIGKILL "
                f"(state {state}: uninterruptible sleep, e.g. a hung file system)"
            )
        return "; ".join(parts)

    def _tell_busy(self) -> None:
        """Tell the other nodes that a rank of this node is slow, not hung (every poll while it is)."""
        if self._peers is not None:
            self._peers.tell()

    def _waiting_elsewhere(self, hung: list[HangHit]) -> bool:
        """Whether another node said lately (:mod:`.peers`) that a rank of its is slow, not hung:
        ``hung`` (silent, not busy) are then waiting for it in a collective. One ``slow_section``
        event (``waiting_for_node``) per such wait."""
        other = self._peers.busy_node() if self._peers is not None else None
        if other is not None and self._waited != other:
            self._waited = other
            h = hung[0]
            self.events.emit(
                "slow_section",
                h.step,
                **_hit_details(h, None),
                waiting_ranks=[w.worker.global_rank for w in hung],
                waiting_for_node=other,
            )
            console.say(
                f"rank(s) {[w.worker.global_rank for w in hung]} silent {h.silent:.1f} s in '{h.section}': waiting "
                f"for a slow (busy, not hung) rank of node {other}"
            )
        if other is None:
            self._waited = None
        return other is not None

    def _word_may_come(self, hung: list[HangHit]) -> bool:
        """Whether silent, idle ``hung`` ranks of a node among several are within
        :data:`~.peers.WORD_GRACE` of their timeouts: another node's word that its rank is slow
        (busy, not hung) may still come, and they would be waiting for it. ``False`` on one node,
        and when a rank is stopped (state T: it waits for no one)."""
        if self._peers is None or any(h.stopped for h in hung):
            return False
        return any(h.silent - h.limit < WORD_GRACE for h in hung)

    def _waiting(self, hung: list[HangHit], busy: list[HangHit], now: float) -> list[HangHit]:
        """The silent ranks of ``hung`` that are not ``busy``: they wait for a busy rank in a
        collective. Noted at ``now``: when the busy rank moves on, the collective completes on
        them a moment later, and until then their silence is the busy rank's, not theirs."""
        waiting = [h for h in hung if h not in busy]
        for h in waiting:
            self._waited_until[h.worker.local_rank] = now
        return waiting

    def _report_slow(self, busy: list[HangHit], waiting: list[HangHit], pids: dict[int, int], now: float) -> None:
        """A ``slow_section`` event (with the busy rank's stacks) and one console line, once per
        silence of each busy rank."""
        for h in busy:
            started = now - h.silent
            if abs(self._slow.get(h.worker.local_rank, -1.0) - started) < 1.0:
                continue  # this silence was reported
            self._slow[h.worker.local_rank] = started
            pid = pids.get(h.worker.local_rank)
            stacks = self.dump_stacks(h.worker.local_rank, h.worker.global_rank, pid, "slow")
            share, demand = self.cpu.share(pid), self.cpu.demand(pid)
            self.events.emit(
                "slow_section",
                h.step,
                **_hit_details(h, stacks),
                cpu_share=round(share, 3) if share is not None else None,
                cpu_demand=round(demand, 3) if demand is not None else None,
                waiting_ranks=[w.worker.global_rank for w in waiting],
            )
            console.say(
                f"rank {h.worker.global_rank} is busy {h.silent:.1f} s in '{h.section}' past its "
                f"timeout {h.limit:.1f} s (main thread at {100 * (share or 0):.0f} % of a core): slow, not hung; "
                + section_advice(stacks)
                + (f"; stacks in {stacks}" if stacks else "")
            )

    def _check(self, worker: Any, pid: Optional[int], now: float) -> Optional[HangHit]:
        """The rank of ``worker`` (process ``pid``) as a hit when it is over its timeout, or silent
        and seen stopped for ``stopped_grace``; else ``None``."""
        local_rank = worker.local_rank
        reader = self._reader(local_rank)
        if reader is None:
            silent, limit = now - self._replaced_at.get(local_rank, self._started), self.book.timeout(INITIAL)
            return HangHit(worker, INITIAL, silent, limit, None) if silent > limit else None
        state = reader.state()
        if state is None:  # mid-write: time it from its last consistent state (a writer stopped
            state = self._last_states.get(local_rank)  # in the middle of a write must not look alive)
            if state is None:
                return None
        self._last_states[local_rank] = state
        section = state.section or OUT_OF_SECTION
        silent = now - (state.entered if state.section else state.last_closed)
        limit = self.book.timeout(section)
        if silent > limit:
            return HangHit(worker, section, silent, limit, state.step)
        grace = self.cfg.stopped_grace  # (a rank heard from within the last poll is running: not read)
        if grace and silent >= LOOK_AFTER and (stopped := self.stopped.seconds(pid, now)) >= grace:
            return HangHit(worker, section, silent, limit, state.step, round(stopped, 3))
        return None

    def _reader(self, local_rank: int) -> Optional[HeartbeatReader]:
        reader = self._readers.get(local_rank)
        if reader is None:
            try:
                reader = self._readers[local_rank] = HeartbeatReader(
                    heartbeat_path(attempt_dir(self.hb_root, self.attempt), local_rank)
                )
            except (FileNotFoundError, ValueError):
                return None
        return reader

    def _learn(self) -> None:
        self._last_learn = time.monotonic()
        if self._frozen:
            return
        self.book.set_live([r.histograms() for r in self._readers.values()])

    def killed(self, pid: Optional[int]) -> bool:
        """Whether this supervisor SIGKILLed process ``pid`` in the current group (a hung rank)."""
        return pid in self._killed

    def dump_stacks(self, local_rank: int, global_rank: int, pid: Optional[int], tag: str = "") -> Optional[Path]:
        """Dump ``pid``'s stacks (see :func:`~.stacks.dump_stacks`) into
        ``RUN_DIR/stacks/attempt<A>-rank<R>[-tag].txt``; ``None`` if none could be taken."""
        dest = self.run_dir / "stacks" / f"attempt{self.attempt}-rank{global_rank}{'-' + tag if tag else ''}.txt"
        src = stack_path(attempt_dir(self.hb_root, self.attempt), local_rank)
        return dump_stacks(src, dest, pid, self.cfg.stacks_wait)

    def _close_readers(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers = {}
        self._last_states = {}


def _hit_details(h: HangHit, stacks: Optional[Path]) -> dict[str, Any]:
    """The event fields of a silent rank (``hang_detected``, ``slow_section``): its ranks, section,
    silence and timeout (seconds) and the path of its stack dump."""
    return {
        "rank": h.worker.global_rank,
        "local_rank": h.worker.local_rank,
        "section": h.section,
        "silent_seconds": round(h.silent, 3),
        "timeout": round(h.limit, 3),
        "stacks": str(stacks) if stacks else None,
    }
