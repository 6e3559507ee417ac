"""Learned section timeouts and the hang decision in one process.

``tests/test_heartbeat.py`` checks the formula ``max(min_timeout, safety_factor × p99, longest)``
on hand-made histograms. Here: when a timeout counts as learned (``min_samples`` over earlier
launches and the running one together), what is never learned, the path from a rank's real
heartbeat record (:class:`HeartbeatWriter` → :class:`HeartbeatReader` → :class:`TimeoutBook`), and
:class:`HangMonitor` deciding with a timeout learned by an earlier launch (``timeouts.json``):
over it is hung, except while a local peer that is not ahead is still within its own timeout.

The monitor polls real heartbeat records in ``tmp_path``; the agent it asks for the workers is a
two-method stand-in returning torch elastic ``Worker`` objects and no process ids (so nothing is
signalled or killed). Hang cases wait until the silence has passed the timeout, whatever it takes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import pytest
from torch.distributed.elastic.agent.server.api import Worker

from trainguard.config import load_config
from trainguard.events import EventLog, read_events
from trainguard.sections import SupervisorSection
from trainguard.supervisor.evidence import StopWatch, process_state
from trainguard.supervisor.heartbeat import (
    NBUCKETS,
    OUT_OF_SECTION,
    HeartbeatReader,
    HeartbeatWriter,
    bucket_of,
    bucket_upper,
    heartbeat_path,
)
from trainguard.supervisor.monitor import HangHit, HangMonitor, attempt_dir, stuck_first
from trainguard.supervisor.timeouts import FILENAME, INITIAL, TEARDOWN, TimeoutBook, percentile_of


def hist(n: int, seconds: float) -> tuple[int, float, list[int]]:
    buckets = [0] * NBUCKETS
    buckets[bucket_of(seconds)] = n
    return n, seconds, buckets


def history(sections: dict[str, tuple[int, float, list[int]]]) -> dict:
    return {
        "sections": {name: {"count": c, "longest": longest, "buckets": b} for name, (c, longest, b) in sections.items()}
    }


# ------------------------------------------------------------------------------------------------
# the book


@pytest.mark.parametrize(
    "earlier, now, learned", [(15, 4, False), (15, 5, True), (0, 20, True), (20, 0, True), (19, 0, False)]
)
def test_min_samples_counts_earlier_launches_and_the_running_one_together(earlier, now, learned):
    cfg = SupervisorSection(step_timeout=77, min_samples=20)
    book = TimeoutBook(cfg, history({"step": hist(earlier, 1.0)}) if earlier else None)
    if now:
        book.set_live([{"step": hist(now, 1.0)}])
    assert (book.learned("step") is not None) is learned
    assert book.timeout("step") == (pytest.approx(3 * bucket_upper(bucket_of(1.0))) if learned else 77)
    book.close_attempt()  # a restart keeps what was seen
    assert book.observed("step")[0] == earlier + now and (book.learned("step") is not None) is learned


@pytest.mark.parametrize(
    "durations, winner",
    [
        ([(100, 0.001)], "min_timeout"),
        ([(100, 1.0)], "p99"),
        ([(99, 1.0), (1, 30.0)], "longest"),  # one outlier: p99 stays low, the longest still never times out
    ],
)
def test_each_term_of_the_formula_can_be_the_one_in_force(durations, winner):
    cfg = SupervisorSection(min_timeout=2.0, safety_factor=3.0, percentile=99)
    buckets = [0] * NBUCKETS
    for n, s in durations:
        buckets[bucket_of(s)] += n
    book = TimeoutBook(cfg)
    book.set_live([{"eval": (sum(n for n, _ in durations), max(s for _, s in durations), buckets)}])
    terms = {"min_timeout": 2.0, "p99": 3.0 * percentile_of(buckets, 99), "longest": max(s for _, s in durations)}
    assert max(terms, key=terms.get) == winner
    assert book.timeout("eval") == pytest.approx(terms[winner])


def test_teardown_and_initial_are_never_learned_from_the_ranks_records():
    cfg = SupervisorSection(
        teardown_timeout=41, initial_timeout=43, section_timeouts={"eval": 47}, user_section_timeout=53
    )
    book = TimeoutBook(cfg)
    book.set_live([{TEARDOWN: hist(500, 0.01), "eval": hist(5, 0.01)}])
    assert book.learned(TEARDOWN) is None and book.timeout(TEARDOWN) == 41
    assert book.timeout(INITIAL) == 43 and book.timeout("eval") == 47 and book.timeout("export") == 53


def test_a_ranks_real_record_teaches_the_book(tmp_path):
    writer = HeartbeatWriter(tmp_path / "rank-0.hb")
    for step in range(1, 26):
        with writer.section("step"):
            sum(range(1000))
        writer.beat(step)
    reader = HeartbeatReader(tmp_path / "rank-0.hb")
    try:
        seen = reader.histograms()
        count, longest, buckets = seen["step"]
        assert count == 25 and sum(buckets) == 25 and 0 < longest < 60
        assert seen[OUT_OF_SECTION][0] == 25  # the gaps before each step
        cfg = SupervisorSection(min_timeout=1e-4)
        book = TimeoutBook(cfg)
        book.set_live([seen])
        want = max(1e-4, 3 * percentile_of(buckets, 99), longest)
        assert book.learned("step") == pytest.approx(want) and book.learned("step") >= longest
        book.save(tmp_path)  # what the next launch starts from
        again = TimeoutBook.load(cfg, tmp_path)
        assert again.timeout("step") == pytest.approx(want) and again.live == {}
    finally:
        reader.close()
        writer.close_file()


# ------------------------------------------------------------------------------------------------
# the monitor's decision


class Agent:
    """What HangMonitor.poll asks of the launcher's agent: the node's workers and their pids."""

    def __init__(self, n: int):
        self._workers = [
            Worker(local_rank=r, global_rank=10 + r, role_rank=r, world_size=n, role_world_size=n) for r in range(n)
        ]

    def workers(self) -> list[Worker]:
        return self._workers

    def worker_pids(self) -> dict[int, int]:
        return {}  # nothing to signal: the decision is under test, not the kill


def wait_until(predicate: Callable[[], object], timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail("condition not reached")


@pytest.fixture
def node(tmp_path):
    """A run dir whose earlier launch learned a 0.3 s step timeout, a monitor over two local ranks."""
    run_dir, hb_root = tmp_path / "run", tmp_path / "hb"
    run_dir.mkdir()
    cfg = load_config(None, [f"run.dir={run_dir}", "supervisor.min_timeout=0.3", "supervisor.step_timeout=600"])
    earlier = TimeoutBook(cfg.supervisor)
    earlier.set_live([{"step": hist(40, 0.01)}])
    earlier.save(run_dir)
    log = EventLog(run_dir)
    monitor = HangMonitor(cfg, run_dir, hb_root, log)
    monitor.group_started(0)
    attempt_dir(hb_root, 0).mkdir(parents=True)
    writers = [HeartbeatWriter(heartbeat_path(attempt_dir(hb_root, 0), r)) for r in (0, 1)]
    yield monitor, writers, run_dir, hb_root
    monitor.group_stopped()
    for w in writers:
        w.close_file()
    log.close()


def silent_for(hb_root: Path, local_rank: int, seconds: float) -> bool:
    """Whether the rank has been in its current section for more than ``seconds`` (read from its record)."""
    reader = HeartbeatReader(heartbeat_path(attempt_dir(hb_root, 0), local_rank))
    try:
        state = reader.state()
    finally:
        reader.close()
    return state is not None and time.monotonic() - state.entered > seconds


def test_a_timeout_learned_by_an_earlier_launch_decides_the_hang(node):
    monitor, (a, b), run_dir, _ = node
    assert monitor.book.timeout("step") == pytest.approx(0.3) and monitor.book.learned("step") is not None
    agent = Agent(2)
    for w in (a, b):
        w.beat(4)
        w.open("step")
    b.close()
    b.beat(5)
    b.open("eval")  # the peer moved on into a long section of its own (600 s)
    reason = wait_until(lambda: monitor.poll(agent))  # rank 0 stays in its step 5 past 0.3 s
    assert reason.startswith("hang: rank 10 silent ") and "in 'step' (timeout 0.3 s)" in reason
    (hang,) = [e["details"] for e in read_events(run_dir, "hang_detected")]
    assert (hang["rank"], hang["local_rank"], hang["section"], hang["learned"]) == (10, 0, "step", True)
    assert hang["timeout"] == pytest.approx(0.3) and hang["silent_seconds"] >= 0.3  # rounded to ms
    monitor.group_stopped()  # the observations up to the hang are kept, and saved for the next launch
    saved = json.loads((run_dir / FILENAME).read_text())
    assert saved["sections"]["step"]["count"] >= 40 and saved["sections"]["step"]["learned"] is True


def test_a_rank_waiting_for_a_peer_that_is_not_ahead_is_not_hung(node):
    monitor, (a, b), run_dir, hb_root = node
    agent = Agent(2)
    a.beat(5)
    a.open("step")  # in the step's collective, waiting for rank 1
    b.beat(5)
    b.open("eval")  # rank 1 evaluates on its own before the step (600 s)
    wait_until(lambda: silent_for(hb_root, 0, 0.35))
    assert monitor.poll(agent) is None  # over its 0.3 s, but its peer is within its own timeout
    assert not list(read_events(run_dir, "hang_detected"))
    b.close()
    b.beat(6)
    b.open("eval")  # rank 1 is now ahead: rank 0 is not waiting for it
    reason = monitor.poll(agent)
    assert reason is not None and "rank 10" in reason and "rank 11" not in reason


def test_idle_ranks_of_a_node_among_several_get_a_grace_for_the_other_nodes_word(node):
    """A node among several (its monitor shares the recovery store): its two ranks sit idle in a
    collective, silent past their 0.3 s timeout. The slow rank of another node would say so only
    once its own timeout passed; so for WORD_GRACE past the timeout a poll says nothing, and the
    same silence is a hang after it when no word came (the grace is not an exemption)."""
    from trainguard.rejoin.auth import Seal
    from trainguard.rejoin.protocol import RecoveryStore, serve
    from trainguard.supervisor.peers import WORD_GRACE

    monitor, (a, b), run_dir, hb_root = node
    monitor.share_busy(RecoveryStore(serve(), 1, Seal(bytes(range(32)))), 1, 2)
    agent = Agent(2)
    limit = monitor.book.timeout("step")
    for attempt in range(5):  # a poll that came later than the grace (a stalled machine) tries again
        for w in (a, b):
            w.beat(4 + attempt)
            w.open("step")
        wait_until(lambda: silent_for(hb_root, 0, limit) and silent_for(hb_root, 1, limit))
        hangs = len(list(read_events(run_dir, "hang_detected")))
        reason = monitor.poll(agent)
        if not silent_for(hb_root, 0, limit + WORD_GRACE):
            break
        for w in (a, b):
            w.close()
    assert reason is None  # within the grace: the word may still come
    assert len(list(read_events(run_dir, "hang_detected"))) == hangs
    reason = wait_until(lambda: monitor.poll(agent))
    assert reason.startswith("hang: rank 10 silent ") and silent_for(hb_root, 0, limit + WORD_GRACE)


def test_of_two_silent_ranks_only_the_one_behind_is_hung(node):
    """Rank 1 stops after step 4; rank 0 finished step 5 and waits for it in step 6's collective.
    Both are over their timeouts, but only rank 1 is hung: in-process recovery must keep rank 0."""
    monitor, (a, b), run_dir, hb_root = node
    agent = Agent(2)
    b.beat(4)
    b.open("step")  # stopped inside step 5
    a.beat(5)
    a.open("step")  # inside step 6, waiting for rank 1 in its all-reduce
    wait_until(lambda: silent_for(hb_root, 0, 0.35) and silent_for(hb_root, 1, 0.35))
    reason = monitor.poll(agent)
    assert reason is not None and "rank 11" in reason and "rank 10" not in reason
    assert [e["details"]["local_rank"] for e in read_events(run_dir, "hang_detected")] == [1]


def test_of_ranks_silent_in_the_same_step_the_stopped_one_is_hung():
    """Two ranks silent in the same step: the one that is stopped (SIGSTOP) is the hung one; the
    other sleeps in a collective waiting for it. Neither stopped: both stay hung."""
    agent = Agent(2)
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        pids = {r: p.pid for r, p in enumerate(procs)}
        hits = [HangHit(w, "step", 2.1, 2.0, 99) for w in agent.workers()]
        assert stuck_first(hits, pids) == hits  # both asleep: no way to tell
        os.kill(procs[1].pid, signal.SIGSTOP)
        wait_until(lambda: psutil.Process(procs[1].pid).status() == psutil.STATUS_STOPPED)
        assert [h.worker.local_rank for h in stuck_first(hits, pids)] == [1]
        assert stuck_first(hits, {}) == hits  # pids unknown
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_section_killed_as_hung_gets_twice_that_silence_on_the_restart_and_later_launches(tmp_path):
    """A section killed at 70 s of silence (past its 60 s timeout) gets 140 s from then on, in this
    launch and, through timeouts.json, in the next; a shorter kill never lowers it; other sections
    keep theirs; a malformed ``interrupted`` value makes the file's section start from the defaults."""
    cfg = SupervisorSection(checkpointing_timeout=60.0)
    book = TimeoutBook(cfg)
    book.interrupted("checkpointing", 70.0)
    book.interrupted("checkpointing", 10.0)
    assert book.timeout("checkpointing") == 140.0 and book.timeout("step") == cfg.step_timeout
    book.save(tmp_path)
    later = TimeoutBook.load(cfg, tmp_path)
    assert (
        later.timeout("checkpointing") == 140.0 and later.snapshot()["sections"]["checkpointing"]["interrupted"] == 70.0
    )
    saved = json.loads((tmp_path / "timeouts.json").read_text())
    saved["sections"]["checkpointing"]["interrupted"] = float("nan")
    assert TimeoutBook(cfg, saved).timeout("checkpointing") == 60.0


class LiveAgent(Agent):
    """An agent whose workers are real processes (``pids``: ``{local_rank: pid}``)."""

    def __init__(self, pids: dict[int, int]):
        super().__init__(len(pids))
        self.pids = pids

    def worker_pids(self) -> dict[int, int]:
        return self.pids


def test_the_stop_watch_counts_only_an_unbroken_stop_it_saw_itself():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        watch = StopWatch()
        assert process_state(proc.pid) in ("S", "R") and watch.seconds(proc.pid, 0.0) == 0.0
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(proc.pid) == "T")
        assert watch.seconds(proc.pid, 10.0) == 0.0  # first seen stopped now, whenever it stopped
        assert watch.seconds(proc.pid, 10.5) == pytest.approx(0.5)
        os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: process_state(proc.pid) != "T")
        assert watch.seconds(proc.pid, 11.0) == 0.0
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(proc.pid) == "T")
        assert watch.seconds(proc.pid, 12.0) == 0.0  # a new stop starts from zero
        assert watch.seconds(None, 12.0) == 0.0
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) is None and watch.seconds(proc.pid, 13.0) == 0.0  # gone


@pytest.mark.parametrize("grace", [0.3, 0.0])
def test_a_silent_rank_seen_stopped_for_stopped_grace_is_hung_long_before_its_timeout(tmp_path, grace):
    """Rank 1 is SIGSTOPped inside a step whose timeout is 600 s: hung once the monitor has seen it
    stopped for ``stopped_grace``; its peer, asleep (waiting for it), is not. With ``stopped_grace =
    0`` it waits for the timeout: no hang while the stop lasts well past the grace."""
    run_dir, hb_root = tmp_path / "run", tmp_path / "hb"
    run_dir.mkdir()
    cfg = load_config(
        None,
        [
            f"run.dir={run_dir}",
            "supervisor.learn=false",
            f"supervisor.stopped_grace={grace}",
            "supervisor.stacks_wait=0",
        ],
    )
    log = EventLog(run_dir)
    monitor = HangMonitor(cfg, run_dir, hb_root, log)
    monitor.group_started(0)
    attempt_dir(hb_root, 0).mkdir(parents=True)
    writers = [HeartbeatWriter(heartbeat_path(attempt_dir(hb_root, 0), r)) for r in (0, 1)]
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        agent = LiveAgent({r: p.pid for r, p in enumerate(procs)})
        for w in writers:
            w.beat(4)
            w.open("step")
        assert monitor.poll(agent) is None
        os.kill(procs[1].pid, signal.SIGSTOP)
        wait_until(lambda: process_state(procs[1].pid) == "T")
        seen = time.monotonic()
        if not grace:
            while time.monotonic() - seen < 1.0:  # three times the default grace: still within 600 s
                assert monitor.poll(agent) is None
                time.sleep(0.05)
            assert not list(read_events(run_dir, "hang_detected"))
            return
        reason = wait_until(lambda: monitor.poll(agent))
        assert time.monotonic() - seen >= grace
        assert "rank 11" in reason and "rank 10" not in reason and "stopped for" in reason, reason
        (hang,) = [e["details"] for e in read_events(run_dir, "hang_detected")]
        assert hang["local_rank"] == 1 and hang["timeout"] == 180.0 and hang["stopped_seconds"] >= grace, hang
        assert hang["silent_seconds"] < hang["timeout"]
        assert monitor.book.timeout("step") == 180.0  # a stop says nothing of the step's length: not doubled
    finally:
        monitor.group_stopped()
        for w in writers:
            w.close_file()
        log.close()
        for p in procs:
            p.kill()
            p.wait()


def test_a_rank_waiting_for_a_busy_one_is_not_hung_in_the_moment_that_one_moves_on(node):
    """Rank 0 computes past its timeout (busy: slow, not hung) while rank 1 waits for it in the
    step's collective. Rank 0 moves on to the next step a moment before the collective completes on
    rank 1: rank 1 is not hung then (its silence counts from the last poll that saw it waiting),
    but it is once it stays silent for its own timeout after that."""
    monitor, (a, b), run_dir, hb_root = node
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    asleep = subprocess.Popen(["sleep", "60"])
    try:
        agent = LiveAgent({0: busy.pid, 1: asleep.pid})
        for w in (a, b):
            w.beat(29)
            w.open("step")
        started = time.monotonic()
        # within the timeout; the CPU meter fills its window (1 s) past start-up
        while time.monotonic() - started < 1.3:
            for w in (a, b):
                w.close()
                w.beat(29)
                w.open("step")
            assert monitor.poll(agent) is None
            time.sleep(0.05)
        for w in (a, b):
            w.close()
            w.beat(30)
            w.open("step")
        wait_until(lambda: monitor.poll(agent) is None and list(read_events(run_dir, "slow_section")))
        (slow,) = [e["details"] for e in read_events(run_dir, "slow_section")]
        assert (slow["rank"], slow["waiting_ranks"]) == (10, [11]), slow
        assert monitor.poll(agent) is None
        a.close()
        a.beat(31)  # rank 0 moves on; the collective has not completed on rank 1 yet
        a.open("step")
        assert monitor.poll(agent) is None
        assert not list(read_events(run_dir, "hang_detected"))

        def rank_0_steps_on() -> Optional[str]:
            a.close()
            a.beat(32)
            a.open("step")
            return monitor.poll(agent)

        reason = wait_until(rank_0_steps_on)  # rank 1 never moves: hung after its own 0.3 s
        assert "rank 11" in reason and "rank 10" not in reason, reason
    finally:
        for p in (busy, asleep):
            p.kill()
            p.wait()
