"""End to end: the hang supervisor of `trainguard run` on 2 gloo ranks, with injected hangs and kills
(real SIGSTOP, real blocked collectives, real SIGKILL), learned timeouts and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPT, events, final_hash, finish, launch
from trainguard.exitcodes import ExitCode
from trainguard.supervisor import stacks

STEPS = 150  # as test_launcher.py: the clean_hash fixture's run is shared
INTERVAL = "checkpoint.interval=10"  # the clean_hash fixture's interval
MIN_TIMEOUT = 2.0  # [supervisor] min_timeout default
STOPPED_GRACE = 0.3  # [supervisor] stopped_grace default


def log_of(run: Path) -> str:
    return Path(f"{run}.log").read_text(errors="replace")


def only(run: Path, kind: str) -> dict:
    found = events(run, kind)
    assert len(found) == 1, f"expected one {kind} event, got {found}\n{log_of(run)[-3000:]}"
    return found[0]


def assert_finished(run: Path, code: int) -> None:
    assert code == 0, log_of(run)[-4000:]
    assert events(run, "launch_exit")[-1]["details"]["code"] == 0


def check_hang(run: Path, rank: int, section: str = "step") -> dict:
    """The hang_detected event of the injected rank: on time, in ``section``, with a stack dump; returns its details.

    Its peer, waiting for it in a collective, may be reported in the same poll (a few ms of
    difference in silence), even before it: the events of one poll come in local-rank order.
    """
    fault = only(run, "fault_injected")
    hangs = events(run, "hang_detected")
    assert hangs, f"no hang detected\n{log_of(run)[-3000:]}"
    assert fault["attempt"] == 0
    # launcher events all carry attempt 0: tell the attempts apart by the restarted group's start
    restarted = [e["time"] for e in events(run, "workers_started") if e["details"]["restart"] >= 1]
    assert all(h["time"] < min(restarted, default=float("inf")) for h in hangs), f"hang after the restart: {hangs}"
    assert len(hangs) <= 2 and len({h["details"]["rank"] for h in hangs}) == len(hangs), hangs
    mine = [h for h in hangs if h["details"]["rank"] == rank]
    assert mine, f"the injected rank {rank} is not among the hung ones: {hangs}"
    event = mine[0]
    d = event["details"]
    assert d["section"] == section, hangs
    # detected once the section has lasted its timeout: not before (the fault came a little after the
    # section began), and at most 1 s after (polls every 0.1 s); a stopped rank (SIGSTOP) once the
    # launcher has seen it stopped for stopped_grace. ``detected_at`` is the poll's time; the events
    # themselves follow the stack dumps.
    first = hangs[0]["details"]["detected_at"]
    delay = first - fault["time"]
    if d["stopped_seconds"] is None:
        assert d["silent_seconds"] >= d["timeout"]  # detected when silent > timeout; the event rounds to 1 ms
        assert d["timeout"] - 0.5 <= delay <= d["timeout"] + 1.0, (delay, d, hangs)
    else:
        assert STOPPED_GRACE <= delay <= 2 * STOPPED_GRACE + 1.0, (delay, d, hangs)
    assert d["detected_at"] - first <= 1.5, hangs
    assert d["stacks"], d
    for h in hangs:  # the hung ranks' Python stacks, in the run dir
        if h is event or h["details"]["stacks"]:
            stacks = Path(h["details"]["stacks"])
            assert stacks.is_file() and stacks.parent == (run / "stacks").resolve(), h
            assert 'File "' in stacks.read_text(errors="replace"), h
    text = Path(d["stacks"]).read_text(errors="replace")
    # the injected rank's main thread, in the training script. (Not necessarily at the fault: a
    # SIGSTOPped rank is woken with SIGCONT for the dump, and its main thread runs on meanwhile.)
    assert "examples/gpt.py" in text and "in main" in text, text
    return d


def check_recovered(run: Path, code: int, clean: str) -> None:
    assert_finished(run, code)
    assert len(events(run, "group_restart")) == 1
    assert "hang: rank" in only(run, "group_restart")["details"]["reason"]
    assert [e["details"]["restart"] for e in events(run, "workers_started")] == [0, 1]
    assert events(run, "resume")[-1]["attempt"] == 1
    assert not events(run, "give_up")
    assert final_hash(run) == clean


def test_sigstopped_rank_is_detected_dumped_restarted_and_run_matches_clean(tmp_path, clean_hash):
    clean = clean_hash(STEPS)
    run = tmp_path / "run"
    code = finish(
        launch(
            run,
            f"train.max_steps={STEPS}",
            INTERVAL,
            "supervisor.step_timeout=3",
            extra=("--inject", "rank_hung:rank=1,step=60"),
        )
    )
    d = check_hang(run, rank=1)
    # 59 steps × 2 ranks observed: the step timeout is learned, max(min_timeout, 3 × p99, longest)
    # (tiny steps: the 2 s floor on a fast machine; a slow one's p99 bucket can reach 1 s, so no
    # upper bound is asserted); but a stopped rank is hung without waiting for it: once the launcher
    # has seen it stopped for [supervisor] stopped_grace (0.3 s)
    assert d["learned"] is True and d["timeout"] >= MIN_TIMEOUT, d
    assert d["stopped_seconds"] >= STOPPED_GRACE and d["silent_seconds"] < d["timeout"], d
    assert only(run, "fault_injected")["step"] == 60
    check_recovered(run, code, clean)
    # the group restart resumes from the newest checkpoint the first group committed: the SIGCONT
    # that lets the stopped rank dump its stacks also lets it run for a moment, so step 60's may
    # still commit; a background save of step 50 may commit on disk after its event's last chance
    # (rank 0 reports a commit at a step boundary, and it waits in step 60's collective)
    first = [e["step"] for e in events(run, "checkpoint_committed") if e["attempt"] == 0]
    resumed = events(run, "resume")[-1]["details"]["from_step"]
    assert max(first) <= resumed <= 60 and resumed >= 40, (resumed, first)


def test_rank_blocked_before_allreduce_while_peer_waits_inside_it(tmp_path, clean_hash):
    clean = clean_hash(STEPS)
    run = tmp_path / "run"
    code = finish(
        launch(
            run,
            f"train.max_steps={STEPS}",
            INTERVAL,
            "supervisor.step_timeout=3",
            extra=("--inject", "rank_hung:rank=0,step=60,hang=collective"),
        )
    )
    fault = only(run, "fault_injected")
    assert fault["details"]["hang"] == "collective" and fault["rank"] == 0
    d = check_hang(run, rank=0)
    assert d["learned"] is True and d["timeout"] >= MIN_TIMEOUT
    assert "in fire" in Path(d["stacks"]).read_text()  # rank 0's main thread blocked in the injector
    check_recovered(run, code, clean)


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_hang_while_checkpointing_uses_the_checkpointing_timeout(tmp_path, clean_hash):
    clean = clean_hash(STEPS)
    run = tmp_path / "run"
    code = finish(
        launch(
            run,
            f"train.max_steps={STEPS}",
            INTERVAL,
            "supervisor.checkpointing_timeout=4",
            "supervisor.step_timeout=30",
            "supervisor.learn=false",
            "supervisor.stopped_grace=0",  # the timeout is the point: the stopped rank waits for it
            # a synchronous save, in which rank 0 waits for rank 1 (after a background save rank 0
            # trains on, so rank 1 looks like a rank behind its peer: found by the step timeout)
            "checkpoint.async_save=false",
            extra=("--inject", "rank_hung:rank=1,step=20,section=checkpointing"),
        )
    )
    fault = only(run, "fault_injected")
    assert fault["details"]["section"] == "checkpointing" and fault["step"] == 20
    hangs = events(run, "hang_detected")
    assert hangs, log_of(run)[-3000:]
    # rank 1 is stopped inside its save; rank 0 waits inside the same (collective) save: both are
    # hung in "checkpointing", and whichever is seen first, the timeout is the checkpointing one
    for h in hangs:
        assert h["details"]["section"] == "checkpointing", hangs
        assert h["details"]["timeout"] == 4.0 and h["details"]["learned"] is False, hangs
    assert {h["details"]["rank"] for h in hangs} <= {0, 1}
    delay = hangs[0]["details"]["detected_at"] - fault["time"]
    assert 3.5 <= delay <= 5.0, delay
    # the stack dump wakes the SIGSTOPped rank (SIGCONT), so its save may complete before the kill:
    # step 20 is then committed by every rank and verified, and the restart resumes from it
    committed = [e["step"] for e in events(run, "checkpoint_committed") if e["attempt"] == 0]
    assert committed[-1] in (10, 20), committed
    check_recovered(run, code, clean)
    # the restart resumes from the newest committed checkpoint: step 20's commit (a rename) can come
    # just before the kill, without its event (seen once in the README suite)
    resumed = events(run, "resume")[-1]["details"]["from_step"]
    assert resumed in (10, 20) and resumed >= committed[-1], (resumed, committed)


def learned_sections(run: Path) -> dict:
    data = json.loads((run / "timeouts.json").read_text())
    return {name: s for name, s in data["sections"].items() if s["learned"]}


@pytest.mark.soak  # 45 s on 2 cores: scripts/test_soak.sh (CI); keeps the suite under 15 min
def test_timeouts_json_is_learned_floored_and_reused_by_the_next_launch(tmp_path):
    first = tmp_path / "first"
    floor = ("supervisor.step_timeout=30", "supervisor.min_timeout=5")
    assert_finished(first, finish(launch(first, "train.max_steps=40", *floor)))
    saved = json.loads((first / "timeouts.json").read_text())
    assert "min_timeout=5" in saved["formula"]
    step = saved["sections"]["step"]
    assert step["learned"] is True and step["count"] >= 2 * 38, step
    assert sum(step["buckets"]) == step["count"] and step["timeout"] >= step["longest"]
    learned = learned_sections(first)
    assert {"step", "out_of_section"} <= set(learned), learned
    assert all(s["timeout"] >= 5 for s in learned.values()), learned  # the floor, whatever the durations
    assert step["timeout"] < 30
    assert not events(first, "hang_detected")

    # a new run dir that starts from a copy of that file: the step timeout is learned from the start,
    # and a hang at step 5 (4 steps × 2 ranks observed in this launch, fewer than min_samples) is
    # caught after the learned timeout, not after the starting 30 s
    second = tmp_path / "second"
    second.mkdir()
    shutil.copy(first / "timeouts.json", second / "timeouts.json")
    no_stop = "supervisor.stopped_grace=0"  # the learned timeout is the point: the stopped rank waits for it
    code = finish(launch(second, "train.max_steps=40", *floor, no_stop, extra=("--inject", "rank_hung:rank=1,step=5")))
    d = check_hang(second, rank=1)
    assert d["learned"] is True, d
    assert d["timeout"] == pytest.approx(step["timeout"], rel=0.2), (d, step)
    assert_finished(second, code)
    assert len(events(second, "group_restart")) == 1


SLOW_TAIL = """
import runpy, sys, time
runpy.run_path({gpt!r}, run_name="__main__")  # the whole tiny GPT run, same argv
time.sleep({tail})  # then a slow tail after training: final evaluation, export, upload...
"""


def test_slow_tail_after_training_is_not_a_hang(tmp_path):
    # After the last step a rank is out of any section for good. With the out-of-section timeout
    # learned from the millisecond gaps between steps (2 s floor), a tail longer than that must not
    # be taken for a hang: the run has finished, a restart would only resume at the last step.
    script = tmp_path / "gpt_then_slow_tail.py"
    script.write_text(SLOW_TAIL.format(gpt=str(GPT), tail=4.0))
    run = tmp_path / "run"
    code = finish(launch(run, "train.max_steps=30", script=script))
    learned = learned_sections(run)
    assert {"step", "out_of_section"} <= set(learned), learned
    assert all(s["timeout"] >= MIN_TIMEOUT for s in learned.values()), learned
    assert learned["out_of_section"]["timeout"] < 4.0, learned  # the tail is longer than the learned timeout
    assert not events(run, "hang_detected"), events(run, "hang_detected")
    assert_finished(run, code)
    assert len(events(run, "workers_started")) == 1 and not events(run, "group_restart")


def test_fault_at_the_same_step_every_attempt_gives_up(tmp_path):
    run = tmp_path / "run"
    code = finish(
        launch(
            run,
            "train.max_steps=100",
            INTERVAL,
            "checkpoint.jit.enabled=false",  # (with it the restart resumes at step 15 and passes the fault)
            extra=("--inject", "rank_killed:rank=1,step=15,every_attempt=true"),
        )
    )
    assert code == ExitCode.GIVE_UP, log_of(run)[-4000:]
    # the default rule: 2 failures in a row at the same step, well inside the restart budget (3)
    assert [e["step"] for e in events(run, "fault_injected")] == [15, 15]
    give_up = only(run, "give_up")
    assert "step 15" in give_up["details"]["reason"], give_up
    assert len(events(run, "group_restart")) == 1 and not events(run, "restart_budget_spent")
    assert events(run, "launch_exit")[-1]["details"]["code"] == ExitCode.GIVE_UP
    assert "giving up" in log_of(run)


@pytest.mark.soak  # three launches (20 s): the README suite stays under 15 minutes on 2 cores
def test_a_fault_that_recurs_before_the_resumed_first_boundary_is_placed_at_its_step(tmp_path):
    """Rank 1 SIGKILLs itself in step 4, then in the first step of each resumed group (from the
    checkpoint of step 2), before any boundary: the give-up rule names step 3. Before, a resumed
    process's heartbeat record said step 0 until its first boundary, and the launcher said "the
    fault recurs at step 1" (found with torchvision's classification recipe, 2026-12-07)."""
    run = tmp_path / "run"
    worker = Path(__file__).parent / "script_error_worker.py"
    settings = ("checkpoint.interval=2", "checkpoint.async_save=false", "checkpoint.jit.enabled=false")
    proc = launch(run, *settings, script=worker, tiny=False, script_args=("--die-after-resume",))
    code = finish(proc)
    assert code == ExitCode.GIVE_UP, log_of(run)[-4000:]
    assert [e["step"] for e in events(run, "resume")] == [2, 2], events(run, "resume")
    give_up = only(run, "give_up")
    assert give_up["details"]["reason"].startswith("the fault recurs at step 3 (2 failures"), give_up


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case", ["step_timeout=0", "step_timeout=-1", "misspelled_section", "rank_outside_world", "unknown_fault_kind"]
)
def test_bad_supervisor_or_fault_input_exits_2_before_any_worker(tmp_path, case):
    run = tmp_path / "run"
    overrides: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    if case.startswith("step_timeout"):
        overrides = (f"supervisor.{case}",)
        expected = ["supervisor.step_timeout", "greater than 0"]
    elif case == "misspelled_section":
        cfg = write_config(tmp_path / "job.toml", "[supervisr]\nstep_timeout = 60\n")
        extra = ("--config", str(cfg))
        expected = ["[supervisr]", "did you mean [supervisor]", str(cfg)]
    elif case == "rank_outside_world":
        extra = ("--inject", "rank_killed:rank=5,step=3")
        expected = ["rank 5", "world size 2"]
    else:
        extra = ("--inject", "bogus_kind:rank=0,step=1")
        expected = ["bogus_kind", "'rank_killed', 'rank_hung', 'random'"]  # the allowed kinds are listed
    code = finish(launch(run, "train.max_steps=20", *overrides, extra=extra), timeout=120)
    log = log_of(run)
    assert code == ExitCode.BAD_INPUT, log[-3000:]
    assert "trainguard: error:" in log and "Traceback" not in log, log[-3000:]
    for text in expected:
        assert text in log, (text, log[-3000:])
    assert not events(run, "workers_started") and not events(run, "start")
    assert not (run / "logs").exists(), "a worker was started"


STACK_CHILD = """
import faulthandler, signal, sys, time
if sys.argv[1] == "handler":
    faulthandler.register(signal.SIGUSR2, file=open(sys.argv[2], "a"), all_threads=True)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("handler", [True, False])
def test_a_stack_dump_is_asked_only_of_a_process_that_has_its_handler(tmp_path, handler):
    """A replacement rank that has not registered faulthandler yet finds the stack file of the rank
    it replaced beside its heartbeat: the dump signal (SIGUSR2, default action: terminate) is not
    sent to it; a rank with the handler dumps its stacks."""
    src = tmp_path / "rank-0.stack"
    src.write_text("stale dump of the replaced rank\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", STACK_CHILD, "handler" if handler else "none", str(src)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert stacks.catches(proc.pid, stacks.STACK_SIGNAL) is handler
        dest = stacks.dump_stacks(src, tmp_path / "out" / "rank-0.stack", proc.pid, wait=10)
        assert proc.poll() is None  # alive either way
        if handler:
            assert dest is not None and "in <module>" in dest.read_text()
        else:
            assert dest is None and src.read_text() == "stale dump of the replaced rank\n"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "killed,alive,now,expected",
    [
        ({}, {10}, 100.0, []),  # nothing killed
        ({10: 95.0}, {10}, 100.0, []),  # within the grace: still dying
        ({10: 90.0}, {10}, 100.0, [10]),  # the grace is over and it is still there
        ({10: 90.0}, set(), 100.0, []),  # it exited
        ({11: 80.0, 10: 90.0, 12: 99.0}, {10, 11, 12}, 100.0, [10, 11]),
    ],
)
def test_a_rank_that_outlives_its_sigkill_by_the_kill_grace_is_unkillable(killed, alive, now, expected):
    """A rank in uninterruptible sleep does not exit on SIGKILL: after ``kill_grace`` (here 10 s)
    the monitor stops waiting for it and the group restarts instead of waiting for its exit code
    forever, dumping stacks every poll (issue: bounded everything)."""
    from trainguard.supervisor.monitor import unkillable

    assert unkillable(killed, alive, now, 10.0) == expected


@pytest.mark.soak  # about a minute on 2 cores: scripts/test_soak.sh (CI)
def test_a_busy_rank_whose_stack_never_moves_is_hung_not_slow(tmp_path):
    """Rank 1 spins in place at step 25 (busy, the same stack in every dump): first slow, as any
    busy rank past its timeout, then hung once its stack stayed the same for spin_factor × the
    learned step timeout; the group restarts and finishes."""
    run = tmp_path / "run"
    proc = launch(
        run, "train.max_steps=40", "checkpoint.interval=10", extra=("--inject", "rank_hung:rank=1,step=25,hang=spin")
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    (hang,) = [e["details"] for e in events(run, "hang_detected")]
    assert hang["rank"] == 1 and hang["section"] == "step" and hang["learned"], hang
    assert hang["stuck_in_place"] >= 5 * hang["timeout"], hang
    assert [e["details"]["rank"] for e in events(run, "slow_section")] == [1]
    assert len(events(run, "group_restart")) == 1 and events(run, "end")


def test_main_stack_is_the_last_thread_of_the_newest_dump():
    dump = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "ping.py", line 109 in _next\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "train.py", line {line} in step\n'
        '  File "train.py", line 79 in <module>\n'
    )
    older, newer = dump.format(line=10), dump.format(line=12)
    assert (
        stacks.main_stack(older + newer) == '  File "train.py", line 12 in step\n  File "train.py", line 79 in <module>'
    )
    assert stacks.main_stack(older + newer) != stacks.main_stack(older)
    assert stacks.main_stack(older + '  File "x.py", line 1 in f\n') is None  # a dump cut short
