"""Stop-check decisions in one process: the flags every rank packs, their agreement (element-wise
max), the reason's priority, the time-limit rule, the next check, the switch files, the SLURM end
time as the ranks read it; then the Guard acting on them (world size 1, a real gloo group).

Signals are real (``signal.raise_signal`` to this process, under the handler being tested), switch
files real files, the end time the launcher's real end-time file, memory the process's real
resident set. Time-limit cases keep every margin at tens of seconds, so the machine's speed cannot
change a decision.
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainguard
from trainguard import dist as tgdist
from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.events import EventLog, read_events
from trainguard.faults import FaultInjector
from trainguard.guard.stop_check import STEP_SECONDS_DECAY, StopCheck
from trainguard.health.straggler import StragglerDetector
from trainguard.instability.fold import LossFold
from trainguard.launch_env import END_TIME, END_TIME_FILE, LAUNCH_TIME
from trainguard.outcomes import Requeue
from trainguard.ranks import Ranks
from trainguard.sections import CheckpointSection, FaultSpec, MemorySection, StopSection, StragglerSection
from trainguard.slurm.endtime import write_end_time
from trainguard.stop.conditions import StopConditions, StopFlags
from trainguard.stop.memory import MemoryWatchdog
from trainguard.stop.signals import ShutdownHandler


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """No end time or launch time from a launcher around the tests (set per test where wanted)."""
    for name in (END_TIME, END_TIME_FILE, LAUNCH_TIME):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():  # a Guard that stopped has destroyed it, as a real run does
        dist.destroy_process_group()


def events(run_dir: Path, kind: str) -> list[dict]:
    return list(read_events(run_dir, kind))


# ------------------------------------------------------------------------------------------------
# the flags and their agreement


def test_flags_pack_in_declaration_order_and_unpack_ignores_the_straggler_tail():
    f = StopFlags(signal=0, kill_switch=1, time_limit=0, memory=1, save_switch=1, next_interval=37, grow=4)
    assert StopFlags.size() == 7 and f.pack() == [0, 1, 0, 1, 1, 37, 4]
    assert StopFlags.unpack(f.pack() + [123456, 7, 8]) == f
    assert StopFlags().pack() == [0, 0, 0, 0, 0, 1, 0] and StopFlags().reason is None
    assert StopFlags(grow=3).reason is None  # growing back is not a stop


@pytest.mark.parametrize(
    "raised, reason",
    [
        ({"signal", "kill_switch", "time_limit", "memory"}, "signal"),
        ({"kill_switch", "time_limit", "memory"}, "kill_switch"),
        ({"time_limit", "memory"}, "time_limit"),
        ({"memory"}, "memory"),
        ({"save_switch"}, None),  # a save, not a stop
        (set(), None),
    ],
)
def test_the_stop_reason_follows_the_priority(raised, reason):
    assert StopFlags(**{name: 1 for name in raised}).reason == reason


def test_ranks_agree_on_the_union_of_their_flags_and_the_latest_next_check(group):
    ranks = [
        StopFlags(time_limit=1, next_interval=3),
        StopFlags(memory=1, next_interval=12),
        StopFlags(save_switch=1, next_interval=1),
        StopFlags(signal=1, next_interval=5),
    ]
    agreed = StopFlags.unpack([max(col) for col in zip(*(f.pack() for f in ranks))])  # all_reduce(MAX)
    assert agreed == StopFlags(signal=1, time_limit=1, memory=1, save_switch=1, next_interval=12)
    assert agreed.reason == "signal"
    without_signal = StopFlags.unpack([max(col) for col in zip(*(f.pack() for f in ranks[:3]))])
    assert without_signal.reason == "time_limit" and without_signal.save_switch == 1
    # the Guard's collective over a real group returns the same vector (world size 1: this rank's)
    assert tgdist.all_reduce_max(ranks[1].pack() + [99, 4]) == ranks[1].pack() + [99, 4]


def test_straggler_scores_ride_in_the_same_vector_and_every_rank_names_the_same_straggler(tmp_path):
    """Two ranks' detectors (world size 2, no collective: the element-wise max is the all-reduce)."""
    cfg = StragglerSection(warmup_steps=0, min_samples=5, report_interval_steps=10)
    logs = [EventLog(tmp_path, r) for r in (0, 1)]
    dets = [StragglerDetector(cfg, Ranks(r, 2, ["fast-host", "slow-host"]), logs[r], tmp_path) for r in (0, 1)]
    for _ in range(6):
        dets[0].record_step(0.010)
        dets[1].record_step(0.025)
    assert all(d.due(10) for d in dets)
    vectors = [StopFlags(next_interval=4 + r).pack() + d.pack() for r, d in enumerate(dets)]
    agreed = [max(col) for col in zip(*vectors)]
    assert StopFlags.unpack(agreed) == StopFlags(next_interval=5)
    assert [d.unpack(10, agreed[StopFlags.size() :]) for d in dets] == [[1], [1]]  # 0.010 / 0.025 = 0.4 < 0.7
    (found,) = events(tmp_path, "straggler_detected")  # written once, by rank 0
    assert found["rank"] == 0 and found["details"]["rank"] == 1 and found["details"]["host"] == "slow-host"
    assert found["details"]["relative"] == pytest.approx(0.4)
    assert dets[0].next_report == dets[1].next_report  # the next report at the same step everywhere
    for log in logs:
        log.close()


def _window(dets: list, step: int, seconds: list[float]) -> list[list[int]]:
    """One report window: rank r's compute takes ``seconds[r]`` for 5 steps; returns each rank's
    stragglers after the exchange (the element-wise max is the all-reduce)."""
    for d, sec in zip(dets, seconds):
        for _ in range(5):
            d.record_step(sec)
            d.record_compute(sec)
    agreed = [max(col) for col in zip(*(d.pack() for d in dets))]
    return [d.unpack(step, agreed) for d in dets]


def test_individual_score_is_against_the_usual_window_not_one_lucky_one(tmp_path):
    """A clean run on a shared machine: one unusually fast window (3.5 ms among 5 ms ones) must not
    make later ordinary windows look like a 30 % slowdown (best-window baselines flagged clean
    runs at 0.65-0.70 in CI); a real slowdown of the whole job (both ranks 5 → 8 ms) is flagged."""
    cfg = StragglerSection(warmup_steps=0, min_samples=5, report_interval_steps=5)
    logs = [EventLog(tmp_path, r) for r in (0, 1)]
    dets = [StragglerDetector(cfg, Ranks(r, 2, ["a", "b"]), logs[r], tmp_path) for r in (0, 1)]
    steady = [[0.005, 0.0051], [0.0035, 0.0036], [0.0052, 0.005], [0.005, 0.0049], [0.0053, 0.0052]]
    assert [_window(dets, 5 * (i + 1), w) for i, w in enumerate(steady)] == [[[], []]] * len(steady)
    assert events(tmp_path, "straggler_detected") == []
    assert _window(dets, 30, [0.008, 0.008]) == [[0, 1], [0, 1]]  # usual 5 ms / 8 ms = 0.625 < 0.7 on both
    flagged = events(tmp_path, "straggler_detected")
    assert sorted(e["details"]["rank"] for e in flagged) == [0, 1]
    assert all(e["details"]["relative"] == 1.0 and e["details"]["individual"] < 0.7 for e in flagged)
    for log in logs:
        log.close()


# ------------------------------------------------------------------------------------------------
# the local flags


def conditions(
    run_dir: Path,
    shutdown: Optional[ShutdownHandler] = None,
    memory: Optional[MemoryWatchdog] = None,
    end_time: Optional[float] = None,
    start_time: Optional[float] = None,
    **stop: Any,
) -> StopConditions:
    return StopConditions(
        StopSection(**stop),
        run_dir,
        shutdown or ShutdownHandler(["SIGUSR1"], 300.0),
        memory,
        start_time=start_time,
        end_time=end_time,
    )


@pytest.mark.parametrize(
    "step_seconds, ahead, save, margin, late",
    [
        (100.0, 4, 400.0, 50.0, False),  # (4 + 1) · 100 + 400 + 50 = 950 < 1000 left
        (100.0, 4, 500.0, 50.0, True),  # 1050: the save would not fit
        (100.0, 5, 400.0, 50.0, True),  # one more step until the next check: 1050
        (150.0, 4, 200.0, 50.0, True),  # a slower step: 1000
        (100.0, 4, 400.0, 150.0, True),  # a wider margin: 1050
        (0.0, 1000, 0.0, 950.0, False),
    ],
)
def test_the_time_limit_rule(tmp_path, step_seconds, ahead, save, margin, late):
    """Late when ``left < (steps_ahead + 1) × step + save + time_margin``, with 1,000 s left (the
    cases sit 50 s from the line: elapsed test time only lowers ``left``, and only a late case
    could tolerate that)."""
    stop = conditions(tmp_path, end_time=time.time() + 1000.0, time_margin=margin)
    assert stop.local_flags(step_seconds, save, ahead).time_limit == int(late)


def test_the_limit_is_the_earlier_of_max_duration_and_the_end_time(tmp_path):
    now = time.time()
    assert conditions(tmp_path).time_left() is None  # no limit: never late
    assert conditions(tmp_path).local_flags(1e9, 1e9, 1000).time_limit == 0
    by_duration = conditions(tmp_path, start_time=now - 100.0, max_duration=1100.0)
    assert 999.0 - 60 < by_duration.time_left() <= 1000.0
    both = conditions(tmp_path, start_time=now - 100.0, max_duration=1100.0, end_time=now + 500.0)
    assert 500.0 - 60 < both.time_left() <= 500.0
    passed = conditions(tmp_path, end_time=now - 10.0, time_margin=0.0)
    assert passed.time_left() < 0 and passed.local_flags(0.0, 0.0, 1).time_limit == 1


def test_the_launch_time_counts_for_every_restarted_group(tmp_path, monkeypatch):
    monkeypatch.setenv(LAUNCH_TIME, repr(time.time() - 3000.0))  # the launch began 50 min ago
    stop = StopConditions(StopSection(max_duration=3600.0), tmp_path, ShutdownHandler(["SIGUSR1"], 300.0))
    assert 600.0 - 60 < stop.time_left() <= 600.0


def test_the_job_end_time_is_read_from_the_launchers_file_and_follows_its_changes(tmp_path, monkeypatch):
    path = tmp_path / ".slurm_end_time.7.0"
    write_end_time(path, time.time() + 5000.0)
    monkeypatch.setenv(END_TIME_FILE, str(path))
    monkeypatch.setenv(END_TIME, repr(time.time() + 9000.0))  # the environment's value at start
    stop = StopConditions(StopSection(time_margin=10.0), tmp_path, ShutdownHandler(["SIGUSR1"], 300.0))
    assert stop.local_flags(1.0, 10.0, 5).time_limit == 0 and 5000.0 - 60 < stop.time_left() <= 5000.0
    # `scontrol update TimeLimit=...`: the first node's launcher rewrites the file
    write_end_time(path, time.time() + 15.0)
    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 1_000_000))  # a new mtime, however coarse the clock
    assert stop.local_flags(1.0, 10.0, 5).time_limit == 1  # 15 s left < 6 × 1 + 10 + 10
    write_end_time(path, None)  # unlimited again (an empty file)
    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 2_000_000))
    assert stop.end_time is None and stop.local_flags(1.0, 10.0, 5).time_limit == 0


@pytest.mark.parametrize(
    "check_interval, check_seconds, step_seconds, expected",
    [
        (7, 1.0, 0.001, 7),  # fixed: whatever the step time
        (0, 1.0, 0.3, 4),  # auto: ceil(1.0 / 0.3)
        (0, 1.0, 0.25, 4),
        (0, 1.0, 5.0, 1),  # slow steps: every step
        (0, 1.0, 1e-6, 1000),  # fast steps: clamped to 1,000
        (0, 30.0, 0.01, 1000),
        (0, 1.0, 0.0, 1),  # not measured yet
    ],
)
def test_next_interval(tmp_path, check_interval, check_seconds, step_seconds, expected):
    stop = conditions(tmp_path, check_interval=check_interval, check_seconds=check_seconds)
    assert stop.next_interval(step_seconds) == expected
    assert stop.local_flags(step_seconds, 0.0, expected).next_interval == expected


def test_switch_files_and_the_signal_raise_their_flags(tmp_path):
    shutdown = ShutdownHandler(["SIGUSR1"], 300.0).install()
    try:
        stop = conditions(tmp_path, shutdown=shutdown, kill_switch="STOP_NOW", save_switch="ckpt/SAVE")
        assert stop.local_flags(0.1, 1.0) == StopFlags(next_interval=10)
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "SAVE").touch()
        assert stop.local_flags(0.1, 1.0) == StopFlags(save_switch=1, next_interval=10)
        stop.clear_save_switch()
        stop.clear_save_switch()  # already gone: harmless
        assert not (tmp_path / "ckpt" / "SAVE").exists()
        (tmp_path / "STOP_NOW").touch()
        assert stop.kill_switch() and stop.local_flags(0.1, 1.0).reason == "kill_switch"
        signal.raise_signal(signal.SIGUSR1)  # the handler runs before raise_signal returns
        assert shutdown.received == "SIGUSR1" and shutdown.deadline_timer.armed
        flags = stop.local_flags(0.1, 1.0)
        assert (flags.signal, flags.kill_switch, flags.reason) == (1, 1, "signal")
    finally:
        shutdown.close()  # handlers restored, the hard deadline cancelled
    assert not shutdown.deadline_timer.armed


def test_the_memory_watchdog_measures_every_check_interval_steps(tmp_path):
    log = EventLog(tmp_path, 0)
    watchdog = MemoryWatchdog(MemorySection(rss_limit="1MiB", check_interval=7), log)
    stop = conditions(tmp_path, memory=watchdog)
    assert [stop.local_flags(0.1, 1.0, step=s).memory for s in (3, 6, 7, 8, 13, 14)] == [0, 0, 1, 0, 0, 1]
    fired = events(tmp_path, "memory_watchdog")
    assert [e["step"] for e in fired] == [7, 14]
    assert fired[0]["details"]["exceeded"][0].startswith("resident set ")
    assert "memory.rss_limit=1048576" in fired[0]["details"]["exceeded"][0]
    assert (
        StopConditions(
            StopSection(), tmp_path, ShutdownHandler(["SIGUSR1"], 300.0), MemoryWatchdog(MemorySection(), log)
        )
        .local_flags(0.1, 1.0, step=1000)
        .memory
        == 0
    )
    log.close()


# ------------------------------------------------------------------------------------------------
# the Guard acts on the agreed flags (one process, world size 1)


class AtStep(trainguard.Hook):
    """Does ``action(guard)`` at the end of step ``step`` (before that step's stop check)."""

    def __init__(self, step: int, action):
        self.step, self.action = step, action

    def on_step_end(self, guard, step, loss):
        if step == self.step:
            self.action(guard)


def train(run_dir: Path, max_steps: int, *overrides: str, hooks: tuple = ()) -> Optional[str]:
    """A tiny regression under a Guard in this process; returns the end state hash."""
    cfg = trainguard.load_config(
        None,
        [f"run.dir={run_dir}", "checkpoint.interval=10", "stop.check_interval=1", "health.preflight=false", *overrides],
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = trainguard.ResumableSampler(256, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with trainguard.Guard(cfg, model=model, optimizer=opt, sampler=sampler, hooks=list(hooks)) as guard:
            for _ in guard.steps(max_steps):
                idx = sampler.take(8)
                loss = F.mse_loss(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                guard.step_end(loss=loss.detach())
        return guard.state_sha256


def stopped(run: Path, max_steps: int, *overrides: str, hooks: tuple = ()) -> Requeue:
    with pytest.raises(Requeue) as e:
        train(run, max_steps, *overrides, hooks=hooks)
    assert e.value.exit_code == 75
    return e.value


def committed(run: Path) -> dict[int, str]:
    return {e["step"]: e["details"]["reason"] for e in events(run, "checkpoint_committed")}


def test_guard_stops_on_a_signal_with_a_checkpoint_and_the_relaunch_ends_as_a_clean_run(tmp_path, group):
    clean = train(tmp_path / "clean", 30)
    run = tmp_path / "run"
    pytest_handler = signal.getsignal(signal.SIGTERM)
    out = stopped(run, 30, hooks=(AtStep(13, lambda g: signal.raise_signal(signal.SIGTERM)),))
    assert out.reason == "signal"
    (stop,) = events(run, "stop_requested")
    assert stop["step"] == 13 and stop["details"]["signal"] == "SIGTERM"
    assert committed(run) == {10: "interval", 13: "signal"}
    (exit_ev,) = events(run, "exit")
    assert exit_ev["details"]["code"] == 75 and exit_ev["details"]["reason"] == "signal"
    assert signal.getsignal(signal.SIGTERM) is pytest_handler and not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the relaunch
    assert train(run, 30) == clean
    assert events(run, "resume")[-1]["details"]["from_step"] == 13


def test_guard_kill_switch_mid_run_and_before_training(tmp_path, group):
    run = tmp_path / "run"
    out = stopped(run, 1000, hooks=(AtStep(7, lambda g: (run / "KILL").touch()),))
    assert out.reason == "kill_switch" and committed(run) == {7: "kill_switch"}
    # the switch stays: the next launch leaves before training, without a save
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stopped(run, 1000)
    assert events(run, "stop_requested")[-1]["details"]["before_training"] is True
    assert committed(run) == {7: "kill_switch"} and len(events(run, "start")) == 1


def test_guard_save_switch_saves_removes_the_file_and_continues(tmp_path, group):
    run = tmp_path / "run"
    train(run, 20, "checkpoint.interval=100", hooks=(AtStep(6, lambda g: (run / "SAVE").touch()),))
    assert committed(run) == {6: "save_switch", 20: "final"}
    assert not (run / "SAVE").exists()


def test_guard_stops_when_the_end_time_is_lowered_mid_run(tmp_path, group, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    path = run / ".slurm_end_time.42.0"
    write_end_time(path, time.time() + 100_000.0)
    monkeypatch.setenv(END_TIME_FILE, str(path))

    def lower(guard):  # what the launcher does after `scontrol update TimeLimit=...`
        write_end_time(path, time.time() + 30.0)
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 1_000_000))

    out = stopped(run, 10_000, "stop.time_margin=60", hooks=(AtStep(9, lower),))
    assert out.reason == "time_limit"
    (stop,) = events(run, "stop_requested")
    assert stop["step"] == 9 and stop["details"]["time_left"] < 30.0
    assert stop["details"]["end_time"] == pytest.approx(json.loads(path.read_text()), abs=1e-3)
    assert committed(run) == {9: "time_limit"}


def test_guard_stops_on_the_memory_watchdog(tmp_path, group):
    run = tmp_path / "run"
    out = stopped(run, 100, "memory.rss_limit='1MiB'", "memory.check_interval=7")
    assert out.reason == "memory" and committed(run) == {7: "memory"}
    assert [e["step"] for e in events(run, "memory_watchdog")] == [7]
    assert events(run, "stop_requested")[0]["details"]["limits"]["rss_limit"] == 1048576


# ------------------------------------------------------------------------------------------------
# the Guard's stop check (trainguard.guard.stop_check): in the step's collective, or its own all-reduce


def _stop_checks(tmp_path: Path, intervals: list[int], faults: list[FaultSpec]) -> tuple[list[StopCheck], list]:
    """One StopCheck per rank (world size ``len(intervals)``), each proposing ``check_interval``
    ``intervals[r]``, with its own LossFold; returns them and what to close."""
    n, checks, closing = len(intervals), [], []
    for r, interval in enumerate(intervals):
        (tmp_path / f"r{r}").mkdir()
        log = EventLog(tmp_path / f"r{r}", r)
        world = Ranks(r, n, ["h"] * n)
        ckpt = Checkpointer(CheckpointSection(), tmp_path / f"r{r}", log, torch.nn.Linear(2, 2), None, world)
        injector = FaultInjector(faults, r, n, 0, log)
        injector.arm(100)
        straggler = StragglerDetector(StragglerSection(), world, log, tmp_path / f"r{r}")
        stop = conditions(tmp_path / f"r{r}", check_interval=interval)
        check = StopCheck(stop, ckpt, straggler, LossFold(world), injector, None, world)
        check.fold.connect(stop=check.flags_to_fold, straggler=check.straggler_to_fold)
        checks.append(check)
        closing += [ckpt, log]
    return checks, closing


def _collective(checks: list[StopCheck], step: int) -> None:
    """The step's collective: every rank's values summed, as the DDP hook's all-reduce does."""
    total = torch.stack([c.fold.extra(step, torch.zeros(3)) for c in checks]).sum(0)
    for c in checks:
        c.fold.reduced(step, total.clone())


@pytest.mark.parametrize(
    "faults, folded",
    [
        ([], True),  # every rank's flags rode in the step's collective: no all-reduce of the check's own
        ([FaultSpec(kind="rank_hung", rank=1, step=5, section="stop_check")], False),  # rank 1 needs its own
    ],
)
def test_the_stop_check_agrees_on_the_flags_in_the_steps_collective_or_in_its_own_all_reduce(
    tmp_path, group, faults, folded
):
    """Two ranks proposing the next check in 3 and 12 steps agree on 12 where the flags rode in
    the step's collective. Where one rank's could not (a fault injected into the check), no rank
    uses the collective's: each all-reduces its own (the world-size-1 group here returns a rank's
    own, so rank 0 ends at its own 3, which shows the all-reduce ran)."""
    checks, closing = _stop_checks(tmp_path, [3, 12], faults)
    try:
        assert [c.due(5) and c.folds(5) for c in checks] == [True, folded]
        _collective(checks, 5)
        agreed = [c.agree(5) for c in checks]
        assert [flags.reason for flags, _ in agreed] == [None, None]
        assert [c.next_check for c in checks] == ([17, 17] if folded else [8, 17])
        assert not checks[0].due(7) and checks[0].due(checks[0].next_check)
    finally:
        for part in closing:
            part.close()


def test_the_step_time_the_stop_check_goes_by_is_the_longest_recent_step_decaying(tmp_path):
    checks, closing = _stop_checks(tmp_path, [1], [])
    try:
        (check,) = checks
        check.step_took(0.5)
        check.step_took(0.1)  # one fast step does not make the time limit forget the slow one
        assert check.step_seconds == pytest.approx(0.5 * STEP_SECONDS_DECAY)
        for _ in range(200):
            check.step_took(0.1)
        assert check.step_seconds == pytest.approx(0.1)
        check.step_took(2.0)
        assert check.step_seconds == 2.0
    finally:
        for part in closing:
            part.close()
