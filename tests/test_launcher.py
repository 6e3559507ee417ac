"""End to end: `trainguard run` on 2 gloo ranks with real signals, real kills and real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import REPO, events, final_hash, finish, launch, logged_step, wait_for
from trainguard.exitcodes import ExitCode
from trainguard.report import build_report

STEPS = 150


def test_sigterm_saves_requeues_and_relaunch_is_bitwise_identical(tmp_path, clean_hash):
    run = tmp_path / "run"
    proc = launch(run, f"train.max_steps={STEPS}", "checkpoint.interval=10")
    wait_for(lambda: logged_step(run) >= 35, what="step 35")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == ExitCode.REQUEUE

    stop = events(run, "stop_requested")[-1]
    assert stop["details"]["reason"] == "signal" and stop["details"]["signal"] == "SIGTERM"
    # the launcher's own record (fault campaign seeds 2019, 2025: a SIGTERM that no rank's
    # stop_requested accounted for, once after the ranks had finished training)
    (received,) = events(run, "signal_received")
    assert received["details"]["signal"] == "SIGTERM" and len(received["details"]["forwarded_to"]) == 2
    committed = [e["step"] for e in events(run, "checkpoint_committed")]
    assert stop["step"] in committed, "no checkpoint committed at the stop step"
    assert events(run, "launch_exit")[-1]["details"]["code"] == ExitCode.REQUEUE
    # the console tells the story in trainguard's own lines; torch elastic's error line for 75 is gone
    first = Path(f"{run}.log").read_text(errors="replace")
    for line in (
        "OMP_NUM_THREADS=1 for the 2 ranks",
        f"run {run}: fresh start (no checkpoint), 2 rank(s)",
        f"stop requested at step {stop['step']} (signal SIGTERM): saving, then exit 75",
        f"checkpoint at step {stop['step']} committed (signal)",
        "trainguard: exit 75: stopped and saved; relaunch the same command to resume",
    ):
        assert line in first, (line, first[-3000:])
    assert "exitcode: 75" not in first

    assert finish(launch(run, f"train.max_steps={STEPS}", "checkpoint.interval=10")) == 0
    assert events(run, "resume")[-1]["details"]["from_step"] == stop["step"]
    assert final_hash(run) == clean_hash(STEPS)
    second = Path(f"{run}.log").read_text(errors="replace")[len(first) :]
    assert f"run {run}: resumed at step {stop['step']} from " in second and "trainguard: exit 0: finished" in second


def test_sigkill_of_one_rank_restarts_group_and_matches_clean_run(tmp_path, clean_hash):
    run = tmp_path / "run"
    proc = launch(run, f"train.max_steps={STEPS}", "checkpoint.interval=10")
    # saves run in the background: wait for step 40's commit itself, not for a step number after it
    wait_for(
        lambda: logged_step(run) >= 45 and 40 in [e["step"] for e in events(run, "checkpoint_committed")],
        what="step 45 with step 40's checkpoint committed",
    )
    pids = events(run, "workers_started")[-1]["details"]["pids"]
    os.kill(int(pids["1"]), signal.SIGKILL)
    assert finish(proc) == 0

    assert len(events(run, "group_restart")) == 1
    failed = events(run, "workers_failed")[0]["details"]["exit_codes"]
    assert -signal.SIGKILL in failed.values()
    assert "trainguard: restarting the group (rank failure" in Path(f"{run}.log").read_text(errors="replace")
    # the report names the killed rank, not the peer the launcher stopped because of it
    killed = [i for i in build_report(events(run))["incidents"] if i["kind"] == "rank_killed"]
    assert [i["ranks"] for i in killed] == [[1]], killed
    resumed = events(run, "resume")[-1]
    assert resumed["attempt"] == 1 and resumed["details"]["from_step"] >= 40
    assert final_hash(run) == clean_hash(STEPS)


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores; CI runs it in the soak step
def test_restart_budget_spent_gives_up(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, "train.max_steps=100000", "launcher.max_restarts=1", "supervisor.max_same_step_faults=10")
    for attempt in range(2):
        pids = wait_for(
            lambda a=attempt: [e for e in events(run, "workers_started") if e["details"]["restart"] == a],
            what=f"group {attempt}",
        )[0]["details"]["pids"]
        wait_for(lambda a=attempt: any(e["attempt"] == a for e in events(run, "start")), what="training start")
        os.kill(int(pids["0"]), signal.SIGKILL)
    assert finish(proc) == ExitCode.GIVE_UP
    assert events(run, "restart_budget_spent")


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores; CI runs it in the soak step
def test_time_limit_saves_and_exits_before_the_limit(tmp_path):
    run = tmp_path / "run"
    # the limit counts from the launch, start-up included: two ranks' start-up took 16 s on a loaded
    # 2-core machine, so the limit leaves room for it (the run itself would never end)
    limit = 30.0
    proc = launch(run, "train.max_steps=1000000", f"stop.max_duration={limit}", "stop.time_margin=1")
    assert finish(proc) == ExitCode.REQUEUE
    launched = events(run, "launch")[-1]["time"]
    stop = events(run, "stop_requested")[-1]
    assert stop["details"]["reason"] == "time_limit"
    saved = [e for e in events(run, "checkpoint_committed") if e["step"] == stop["step"]]
    assert saved and saved[0]["time"] - launched < limit
    assert events(run, "exit")[-1]["time"] - launched < limit


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores; CI runs it in the soak step
def test_second_launch_on_locked_run_dir_or_checkpoint_dir_is_refused(tmp_path):
    """One launch per run directory, and per checkpoint directory outside it (an absolute
    ``[checkpoint] dir``): two runs sharing one would delete each other's checkpoints."""
    run, shared = tmp_path / "run", tmp_path / "shared-ckpt"
    first = launch(run, "train.max_steps=100000", f"checkpoint.dir={shared}")
    wait_for(lambda: events(run, "start"), what="first launch training")

    def second(run_dir: Path, *settings: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", "2", "--run-dir", str(run_dir)]
        cmd += [str(REPO / "examples" / "gpt.py"), *[x for s in settings for x in ("--set", s)]]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # a cap, not a speed goal

    r = second(run)
    assert r.returncode == ExitCode.BAD_INPUT
    assert "run dir" in r.stderr and "in use by another launch" in r.stderr and str(first.pid) in r.stderr
    r = second(tmp_path / "other-run", f"checkpoint.dir={shared}")
    assert r.returncode == ExitCode.BAD_INPUT, r.stderr[-2000:]
    assert f"checkpoint dir {shared} is in use by another launch" in r.stderr and str(first.pid) in r.stderr
    first.send_signal(signal.SIGTERM)
    assert finish(first) == ExitCode.REQUEUE


def test_bad_user_key_exits_2_without_restart_and_keeps_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert finish(launch(run, "train.max_steps=20", "checkpoint.interval=5")) == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = launch(run, "train.max_stesp=30")
    assert finish(proc) == ExitCode.BAD_INPUT
    assert "did you mean 'max_steps'" in Path(f"{run}.log").read_text()
    assert not events(run, "group_restart")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_unwritable_run_dir_is_bad_input(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard.cli",
            "run",
            "--run-dir",
            str(blocker / "run"),
            str(REPO / "examples" / "gpt.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == ExitCode.BAD_INPUT
    assert "not writable" in r.stderr and str(blocker / "run") in r.stderr
    assert blocker.read_text() == "not a directory"


def test_sigusr1_to_launcher_reaches_ranks(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, "train.max_steps=100000")
    wait_for(lambda: logged_step(run) >= 5, what="step 5")
    proc.send_signal(signal.SIGUSR1)
    assert finish(proc) == ExitCode.REQUEUE
    stop = events(run, "stop_requested")[-1]
    assert stop["details"]["signal"] == "SIGUSR1"
    assert events(run, "launch_exit")[-1]["details"]["signal"] == "SIGUSR1"


# ---- ranks never outlive their launcher ---------------------------------------------------------

ORPHAN = REPO / "tests" / "orphan_worker.py"


def running(proc: psutil.Process) -> bool:
    """The process still runs (not exited, not a zombie waiting for a parent to reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_ranks_die_with_their_sigkilled_launcher_and_a_relaunch_then_starts(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, "train.max_steps=100000")
    wait_for(lambda: events(run, "start") and logged_step(run) >= 3, what="training")
    ranks = [int(p) for p in events(run, "workers_started")[-1]["details"]["pids"].values()]
    tree = psutil.Process(proc.pid).children(recursive=True)  # the ranks and anything else it started
    assert set(ranks) <= {p.pid for p in tree} and len(ranks) == 2
    record = next((run / ".launches").glob("*.json"))
    recorded = json.loads(record.read_text())
    assert set(ranks) == {r["pid"] for r in recorded["ranks"].values()}
    heartbeats = Path(recorded["heartbeat_dir"])
    assert heartbeats.is_dir()

    proc.kill()  # as the OOM killer would: no handler runs, the launcher cannot stop its ranks
    proc.wait()
    wait_for(lambda: not any(running(p) for p in tree), timeout=5, what=f"the launcher's processes {tree} to die")

    # the record the dead launcher left names only dead processes: a relaunch cleans it up and runs
    relaunch = launch(run, "train.max_steps=100000")
    wait_for(lambda: len(events(run, "start")) == 2, what="the relaunch training")
    assert not record.exists() and not heartbeats.exists()  # the dead launch's heartbeat records too
    relaunch.send_signal(signal.SIGTERM)
    assert finish(relaunch) == ExitCode.REQUEUE
    assert not list((run / ".launches").glob("*.json"))  # a launch that ends removes its record


def orphan_command(run: Path, *args: str) -> list[str]:
    """``trainguard run`` of one rank of tests/orphan_worker.py with ``args``."""
    return [
        sys.executable,
        "-m",
        "trainguard.cli",
        "run",
        "--nproc-per-node",
        "1",
        "--run-dir",
        str(run),
        str(ORPHAN),
        *args,
    ]


@pytest.mark.soak  # 21 s on 2 cores: the README suite keeps its 15 minutes; CI runs it in the soak step
def test_relaunch_is_refused_while_a_rank_of_the_previous_launch_lives(tmp_path):
    run, ready = tmp_path / "run", tmp_path / "orphan.pid"
    with open(f"{run}.log", "ab") as log:
        proc = subprocess.Popen(orphan_command(run, str(ready)), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    survivor = None
    try:
        survivor = psutil.Process(
            int(wait_for(lambda: ready.exists() and ready.read_text(), what="the rank's pid file"))
        )
        wait_for(lambda: events(run, "workers_started"), what="the launcher's record of its rank")
        proc.kill()  # its rank does not die with it (it cleared its parent-death signal)
        proc.wait()
        cmd = orphan_command(run, "--exit")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == ExitCode.BAD_INPUT, r.stderr
        assert "still alive" in r.stderr and str(survivor.pid) in r.stderr and str(run) in r.stderr, r.stderr
        assert len(events(run, "launch")) == 1  # refused before anything started

        survivor.kill()
        wait_for(lambda: not running(survivor), timeout=5, what="the survivor's end")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    finally:
        if survivor is not None and running(survivor):
            survivor.kill()
