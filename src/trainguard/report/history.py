"""Reconstructing a run from its events in one pass, in time order: launches, worker-group
attempts, training segments (:mod:`.timeline`) and incidents (:mod:`.incidents`)."""

from __future__ import annotations

from typing import Any, Optional

from ..exitcodes import ExitCode
from .incidents import DECISION_CODES, FAULTS_FOR, IN_PROCESS_ROLLBACKS, NOTICE_KINDS, STOP_KINDS, Incident
from .load import number
from .timeline import Segment, extrapolate, step_seconds

# a launch event of the same multi-node job joins the open launch (a node joining) only if the open
# launch wrote an event within this many seconds: else its launchers were lost and this is a relaunch
JOIN_WINDOW = 120.0


class RunHistory:
    """Feed it every event (time order), then read ``segments``, ``incidents``, ``checkpoints``,
    ``launch_exits``, ``launches``, ``attempts``, ``progress_seconds``, ``notices`` and
    ``launch_open`` (the newest launch has not exited: running, or its launcher was lost)."""

    def __init__(self, seconds_per_step: Optional[float] = None):
        self.seconds_per_step = seconds_per_step  # for failure steps no event records
        self.segments: list[Segment] = []
        self.incidents: list[Incident] = []
        self.checkpoints: list[dict] = []
        self.launch_exits: list[dict] = []
        self.progress_seconds: list[float] = []
        self.notices: dict[str, int] = {}
        self.launches = self.attempts = 0
        self.seg: Optional[Segment] = None
        self._launch, self._attempt, self.launch_open, self._last_time = 0, 0, False, None
        self._faults: list[dict] = []
        self._pending: list[Incident] = []  # waiting for the next start
        self._open: Optional[Incident] = None  # hang/ping incident the launcher has not acted on yet
        self._instability: dict[tuple, float] = {}
        self._sdc: dict[tuple, float] = {}  # (launch, attempt) -> time of the latest sdc_mismatch
        self._oom: dict[tuple, float] = {}
        self._launchers: list[tuple] = []  # (host, pid) of the open launch's launchers (one per node)
        self._membership = False  # a node waits to join: the ranks were asked to stop with a checkpoint
        self._launch_key: Optional[tuple] = None  # what the open launch's nodes share (multi-node only)

    # -- helpers -------------------------------------------------------------------------------

    def _here(self, e: dict) -> tuple[int, int]:
        """(launch, attempt) of an event: rank events carry their attempt, launcher events do not."""
        return self._launch, (e["attempt"] if e["rank"] is not None else self._attempt)

    def _segment_of(self, launch: int, attempt: int) -> Optional[Segment]:
        seg = self.seg
        return seg if seg is not None and (seg.launch, seg.attempt) == (launch, attempt) else None

    def _new(
        self, kind: str, e: dict, *, failed_at: Optional[float] = None, step: Optional[float] = None, **extra: Any
    ) -> Incident:
        launch, attempt = self._here(e)
        detected = e["details"].get("detected_at", e["time"])  # hang_detected: the poll, before the stack dump
        inc = Incident(
            kind=kind,
            launch=launch,
            attempt=attempt,
            detected_at=detected,
            failed_at=e["time"] if failed_at is None else failed_at,
            step=step,
            segment=self._segment_of(launch, attempt),
            **extra,
        )
        fault = self._match_fault(inc)
        if fault is not None:
            inc.injected, inc.fault_at = True, fault["time"]
            inc.latency = round(inc.detected_at - fault["time"], 6)
            if not inc.in_process:
                inc.failed_at = min(inc.failed_at, fault["time"])
            if fault["step"] is not None and inc.kind not in IN_PROCESS_ROLLBACKS:
                inc.step, inc.step_estimated = float(fault["step"]), False
            if fault["details"].get("rank") is not None:
                inc.ranks = [fault["details"]["rank"]]
        if inc.step is None and inc.segment is not None:
            inc.step, inc.step_estimated = extrapolate(inc.segment, inc.failed_at, self.seconds_per_step)
        self.incidents.append(inc)
        if not inc.in_process:
            self._pending.append(inc)
        return inc

    def _match_fault(self, inc: Incident) -> Optional[dict]:
        kinds = FAULTS_FOR.get(inc.kind, ())
        for f in self._faults:
            if (
                f["used"]
                or (f["launch"], f["attempt"]) != (inc.launch, inc.attempt)
                or f["details"].get("fault") not in kinds
                or f["time"] > inc.detected_at + 1e-6
            ):
                continue
            if inc.in_process and inc.step is not None and f["step"] is not None and f["step"] > inc.step:
                continue  # a numeric or oom fault of a later step than this rollback's or split's
            f["used"] = True
            return f
        return None

    def _end_segment(self, inc: Incident, how: str) -> None:
        seg = inc.segment
        if seg is None or inc.in_process:
            return
        if seg.end is None or (seg.how == how and inc.failed_at < seg.end):  # a later event of the same poll
            seg.end, seg.how = max(inc.failed_at, seg.start), how

    def _terminal(self, kind: str, e: dict, reason: str) -> None:
        launch = self._here(e)[0]
        if any(i.terminal and i.launch == launch for i in self.incidents):
            return  # one terminal incident per launch (the launcher repeats what a rank decided)
        self._new(kind, e, terminal=True, reason=reason)

    # -- events --------------------------------------------------------------------------------

    def feed(self, e: dict) -> None:
        kind = e["kind"]
        if kind in NOTICE_KINDS and not (kind == "instability" and e["details"].get("action") == "rollback"):
            self.notices[kind] = self.notices.get(kind, 0) + 1
        handler = getattr(self, "_on_" + kind, None)
        if handler is not None:
            handler(e, e["details"])
        self._last_time = e["time"]

    def _on_launch(self, e: dict, d: dict) -> None:
        # several nodes of one launch each write a launch event (a node may join later: --nnodes MIN:MAX):
        # another launcher of the same job while the open launch is alive (it wrote an event lately)
        key = (str(d.get("nnodes")), d.get("slurm_job_id"), d.get("slurm_restart_count"))
        who = (d.get("host"), e.get("pid"))
        alive = self._last_time is not None and e["time"] - self._last_time < JOIN_WINDOW
        if self.launch_open and self._launch_key == key and who not in self._launchers and alive:
            self._launchers.append(who)
            return
        if self.launch_open:  # the previous launch never wrote launch_exit: its launcher died
            seg = self.seg
            ev = dict(e, time=self._last_time, rank=None)
            inc = self._new(
                "launch_lost",
                ev,
                step=seg.last_step() if seg else None,
                reason="no launch_exit: the launcher itself was killed or its node lost",
            )
            self._end_segment(inc, "lost")
        self.launches += 1
        self._launch, self._attempt, self.launch_open = self.launches - 1, 0, True
        self.seg, self._open = None, None
        self._launchers, self._membership = [who], False
        self._launch_key = key if str(d.get("nnodes", "1")) not in ("1", "1:1", "None") else None

    def _on_workers_started(self, e: dict, d: dict) -> None:
        if d.get("node", 0) != 0 or "joined_generation" in d:
            return  # another node's part of the group node 0 started, or a node that joined it in place
        self._membership = False  # a membership stop that never came (a failure restarted the group first)
        self.attempts += 1
        restart = d.get("restart")
        self._attempt = restart if isinstance(restart, int) else self._attempt + 1
        self._open = None

    def _on_start(self, e: dict, d: dict) -> None:
        if self.seg is not None and self.seg.end is None:
            self.seg.close(self.seg.points[-1][0], "lost")
        first = d.get("first_step")
        first = first if isinstance(first, int) else (e["step"] or 0)
        launch, attempt = self._here(e)
        world = d.get("world_size")
        self.seg = Segment(
            launch=launch,
            attempt=attempt,
            start=e["time"],
            first_step=first,
            world_size=world if isinstance(world, int) else None,
        )
        self.segments.append(self.seg)
        for inc in self._pending:
            inc.recovered_at, inc.resumed_step = e["time"], float(first)
        self._pending = []

    def _on_world_size_changed(self, e: dict, d: dict) -> None:
        seg = self._segment_of(*self._here(e))
        if d.get("in_process") and e["rank"] == 0 and seg is not None and isinstance(d.get("to_world_size"), int):
            seg.resized.append((e["time"], int(e["step"] or 0), d["to_world_size"]))

    def _add_point(self, e: dict, t: float, step: Optional[float]) -> None:
        seg = self._segment_of(*self._here(e))
        if seg is not None:
            seg.add(t, step)

    def _on_progress(self, e: dict, d: dict) -> None:
        self._add_point(e, e["time"], e["step"])
        if number(d.get("step_seconds")):
            self.progress_seconds.append(float(d["step_seconds"]))

    def _on_checkpoint_committed(self, e: dict, d: dict) -> None:
        self.checkpoints.append(dict(e, launch=self._launch))
        started = number(d.get("started"))
        self._add_point(e, started if started is not None else e["time"] - (number(d.get("seconds")) or 0.0), e["step"])
        self._add_point(e, e["time"], e["step"])

    def _on_fault_injected(self, e: dict, d: dict) -> None:
        launch, attempt = self._here(e)
        self._faults.append(dict(e, launch=launch, attempt=attempt, used=False))
        if d.get("fault") in ("rank_killed", "rank_hung"):
            self._add_point(e, e["time"], e["step"])

    def _on_hang_detected(self, e: dict, d: dict) -> None:
        silent = number(d.get("silent_seconds")) or 0.0
        rank, step = d.get("rank"), e["step"]
        inc = self._open
        if inc is None or inc.kind != "hang":
            inc = self._new(
                "hang",
                e,
                failed_at=e["time"] - silent,
                step=step,
                ranks=[],
                reason=f"rank {rank} silent {silent:.1f} s in '{d.get('section')}' (timeout {d.get('timeout')} s)",
            )
            self._open = inc
        elif not inc.injected:
            inc.failed_at = min(inc.failed_at, e["time"] - silent)
            if step is not None and (inc.step is None or step > inc.step):
                inc.step = float(step)
        if rank is not None and rank not in inc.ranks:
            inc.ranks.append(rank)
        self._end_segment(inc, "failed")

    def _on_ping_timeout(self, e: dict, d: dict) -> None:
        if self._open is not None and self._open.kind == "ping_timeout":
            return
        seg = self._segment_of(*self._here(e))
        timeout = number(d.get("timeout")) or 0.0
        failed = max(e["time"] - timeout, seg.points[-1][0] if seg else e["time"] - timeout)
        missing = d.get("missing_ranks") if isinstance(d.get("missing_ranks"), list) else []
        self._open = self._new(
            "ping_timeout",
            e,
            failed_at=failed,
            step=seg.last_step(failed) if seg else None,
            ranks=missing,
            reason=f"no answer to liveness ping {d.get('ping')} in {timeout:g} s",
        )
        self._end_segment(self._open, "failed")

    def _on_workers_failed(self, e: dict, d: dict) -> None:
        codes = d.get("exit_codes") if isinstance(d.get("exit_codes"), dict) else {}
        if self._open is not None:
            self._open = None  # the launcher acting on a hang or ping timeout already reported
            return
        here = self._here(e)
        if any(i.planned and (i.launch, i.attempt) == here for i in self._pending):
            return  # ranks killed after a stop's grace period: part of that stop
        if any(c in DECISION_CODES[1:] for c in codes.values()):
            return  # a rank decided (bad input, requeue, give up); the launcher stopped the others
        stopped = {str(r) for r in d.get("stopped_by_launcher") or []}  # killed because of the others
        bad = {r: c for r, c in codes.items() if isinstance(c, int) and c not in DECISION_CODES}
        bad = {r: c for r, c in bad.items() if str(r) not in stopped} or bad
        if not bad:
            return
        killed = any(c < 0 for c in bad.values())
        if killed:  # the peers of a killed rank fail in their next collective: a reaction, not the cause
            bad = {r: c for r, c in bad.items() if c < 0}
        withdrawn = all(c == int(ExitCode.WITHDRAWN) for c in bad.values())
        inc = self._new(
            "rank_killed" if killed else "rank_withdrawn" if withdrawn else "rank_crashed",
            e,
            ranks=sorted(int(r) for r in bad if str(r).isdigit()),
            reason="exit codes " + ", ".join(f"rank {r}: {c}" for r, c in sorted(bad.items())),
        )
        self._end_segment(inc, "failed")

    def _on_node_lost(self, e: dict, d: dict) -> None:
        """The leading node's launcher found another node lost (its launcher and ranks gone, or its
        host silent): a failure since its last beat; a spare node's replacement then marks it
        recovered in-process (the launcher's ``recovery_started``)."""
        silent = number(d.get("silent_seconds")) or 0.0
        ranks = d.get("ranks") if isinstance(d.get("ranks"), list) else []
        inc = self._new(
            "node_lost",
            e,
            failed_at=e["time"] - silent,
            ranks=ranks,
            reason=f"node {d.get('node')} ({d.get('host')}) silent {silent:.1f} s",
        )
        self._end_segment(inc, "failed")

    def _on_recovery_started(self, e: dict, d: dict) -> None:
        """The launcher replaces lost ranks in-process (``rank`` null): the failure it just reported
        is recovered without a restart; the training segment goes on."""
        if e["rank"] is not None or not self._pending:
            return
        inc = self._pending.pop()
        inc.in_process = True
        seg = inc.segment
        if seg is not None and seg.how == "failed":
            seg.end, seg.how = None, "running"

    def _on_recovery_finished(self, e: dict, d: dict) -> None:
        """A survivor trains again: the in-process incident's recovery (the first survivor's event).
        Its step plus its ``steps_lost`` is the survivors' last completed step when the peer was lost
        (exact, where the failure's own step was estimated from the time); training resumes at its
        step: the same step (nothing completed trained again), or a sharded model's snapshot."""
        for inc in reversed(self.incidents):
            if (
                inc.in_process
                and inc.recovered_at is None
                and inc.kind in ("rank_killed", "rank_crashed", "rank_withdrawn", "hang", "node_lost")
            ):
                inc.recovered_at, inc.resumed_step = e["time"], float(e["step"])
                inc.step, inc.step_estimated = float(e["step"] + (number(d.get("steps_lost")) or 0)), False
                self._add_point(e, e["time"], e["step"])
                return

    def _on_snapshot_restored(self, e: dict, d: dict) -> None:
        """A sharded model's replacement took its shard from a peer's snapshot copy: said in the
        recovering incident's reason (once)."""
        if d.get("from_step") is not None:
            return
        for inc in reversed(self.incidents):
            if inc.in_process and "snapshot" not in inc.reason:
                inc.reason += f"; rolled back to the snapshot of step {e['step']}, rank {e.get('rank')}'s shard from {d.get('source')}"
                return

    def _on_membership_change(self, e: dict, d: dict) -> None:
        # the launcher's SIGTERM: the next agreed stop is for the new membership (a node that joins
        # in place stops nothing: the ranks' world_size_changed shows it)
        self._membership = not d.get("in_place")

    def _on_stop_requested(self, e: dict, d: dict) -> None:
        reason = str(d.get("reason"))
        kind = STOP_KINDS.get(reason, reason)
        if reason == "signal" and self._membership:
            kind, self._membership = "membership_change", False
        inc = self._new(
            kind,
            e,
            step=e["step"],
            ranks=d.get("ranks") if isinstance(d.get("ranks"), list) else [],
            reason=reason + (f" {d['signal']}" if d.get("signal") else ""),
        )
        signal_time = number(d.get("signal_time"))
        if signal_time is not None and not inc.injected:
            inc.latency = round(e["time"] - signal_time, 6)  # signal received → all ranks agreed to stop
        self._end_segment(inc, "stopped")

    def _on_exit(self, e: dict, d: dict) -> None:
        code = d.get("code")
        seg = self._segment_of(*self._here(e))
        if seg is not None:
            seg.close(e["time"], "finished" if code == 0 else "stopped" if code == 75 else "failed")
        if code == 76:
            self._terminal("give_up", e, str(d.get("reason")))
        elif code == 2:
            self._terminal("bad_input", e, str(d.get("reason")))

    def _on_give_up(self, e: dict, d: dict) -> None:
        self._terminal("give_up", e, f"{d.get('reason')}: {d.get('failure')}")

    def _on_restart_budget_spent(self, e: dict, d: dict) -> None:
        self._terminal("give_up", e, f"restart budget ({d.get('max_restarts')}) spent: {d.get('reason')}")

    def _on_instability_give_up(self, e: dict, d: dict) -> None:
        self._terminal("give_up", e, f"instability: {d.get('reason')}")

    def _on_oom_give_up(self, e: dict, d: dict) -> None:
        self._terminal("give_up", e, f"out of memory: {d.get('reason')}")

    def _on_bad_input(self, e: dict, d: dict) -> None:
        self._terminal("bad_input", e, str(d.get("message")))

    def _on_instability(self, e: dict, d: dict) -> None:
        self._instability[self._here(e)] = e["time"]

    def _on_rollback(self, e: dict, d: dict) -> None:
        bad, to = number(d.get("from_step")), number(d.get("to_step"))
        seen = self._instability.get(self._here(e), e["time"])
        inc = self._new(
            "instability_rollback",
            e,
            failed_at=seen,
            step=bad if bad is not None else e["step"],
            in_process=True,
            reason=f"{', '.join(map(str, d.get('detectors') or []))}: back to step {d.get('to_step')}",
        )
        inc.detected_at, inc.recovered_at, inc.resumed_step = seen, e["time"], to
        if inc.injected and inc.fault_at is not None:
            inc.latency = round(seen - inc.fault_at, 6)
        if inc.step is not None and to is not None:  # the loop was at the bad step, then at the checkpoint's
            self._add_point(e, seen, inc.step)
            self._add_point(e, e["time"], to)

    def _on_sdc_mismatch(self, e: dict, d: dict) -> None:
        self._sdc[self._here(e)] = e["time"]

    def _on_sdc_rollback(self, e: dict, d: dict) -> None:
        bad, to = number(d.get("from_step")), number(d.get("to_step"))
        seen = self._sdc.get(self._here(e), e["time"])
        inc = self._new(
            "sdc_rerun",
            e,
            failed_at=seen,
            step=bad if bad is not None else e["step"],
            in_process=True,
            reason=f"replicas differ at step {d.get('from_step')}: back to step {d.get('to_step')} and re-run",
        )
        inc.detected_at, inc.recovered_at, inc.resumed_step = seen, e["time"], to
        if inc.step is not None and to is not None:
            self._add_point(e, seen, inc.step)
            self._add_point(e, e["time"], to)

    def _on_step_rerun(self, e: dict, d: dict) -> None:
        self._sdc[self._here(e)] = e["time"]

    def _on_sdc_rerun(self, e: dict, d: dict) -> None:
        if d.get("trigger") != "instability" or d.get("verdict") != "transient":
            return  # a replica re-run is reported by its rollback; a data verdict by the instability policy
        seen = self._sdc.get(self._here(e), e["time"])
        step = number(e["step"])
        inc = self._new(
            "sdc_transient",
            e,
            failed_at=seen,
            step=step,
            in_process=True,
            reason=f"step {e['step']} computed differently when run again (ranks {d.get('ranks')}): the re-run was used",
        )
        inc.detected_at, inc.recovered_at = seen, e["time"]
        inc.resumed_step = step - 1 if step is not None else None  # the step was done again

    def _on_oom(self, e: dict, d: dict) -> None:
        self._oom.setdefault(self._here(e) + (e["step"],), e["time"])

    def _on_micro_batch_split(self, e: dict, d: dict) -> None:
        seen = self._oom.get(self._here(e) + (e["step"],), e["time"])
        inc = self._new(
            "oom_split",
            e,
            failed_at=seen,
            step=e["step"],
            in_process=True,
            reason=f"micro-batch {d.get('from_size')} → {d.get('to_size')}",
        )
        inc.detected_at, inc.recovered_at, inc.resumed_step = seen, e["time"], e["step"]
        if inc.injected and inc.fault_at is not None:
            inc.latency = round(seen - inc.fault_at, 6)

    def _on_end(self, e: dict, d: dict) -> None:
        self._add_point(e, e["time"], e["step"])
        seg = self._segment_of(*self._here(e))
        if seg is not None:
            seg.close(e["time"], "finished")

    def _on_launch_exit(self, e: dict, d: dict) -> None:
        mine = next((w for w in self._launchers if w[1] == e.get("pid")), None)
        if mine is not None:
            self._launchers.remove(mine)
        code = d.get("code")
        if code == 76:
            self._terminal("give_up", e, str(d.get("reason")))
        elif code == 2:
            self._terminal("bad_input", e, str(d.get("reason")))
        elif code not in (0, 75):
            self._terminal("launch_failed", e, f"launch exit code {code}: {d.get('reason')}")
        self.launch_exits.append(dict(e, launch=self._launch))
        if self._launchers:  # another node's launcher of this launch is still running
            return
        if self.seg is not None and self.seg.end is None:
            self.seg.close(self.seg.points[-1][0], "lost")
        self.launch_open, self.seg, self._open = False, None, None


def reconstruct(events: list[dict]) -> RunHistory:
    """The history of clean, time-ordered events, in two passes: the first measures the step time,
    which the second uses to estimate the failure step of failures no event gives a step for."""
    first = RunHistory()
    for e in events:
        first.feed(e)
    history = RunHistory(step_seconds(first.segments, first.progress_seconds))
    for e in events:
        history.feed(e)
    return history
