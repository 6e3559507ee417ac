"""End to end on a real local SLURM cluster (scripts/slurm-up.sh): the tiny GPT on 2 ranks, submitted
with ``trainguard slurm submit``, stopped by the job's time limit, by ``scancel --signal=USR1`` and
by ``scontrol requeue``; job arrays; ``sbatch --test-only``; bad input.

Run by ``bash scripts/test_slurm.sh`` (CI runs it after the suite; ``scripts/test.sh`` leaves these out,
marked ``slurm``). Without a reachable cluster they skip; with ``TRAINGUARD_REQUIRE_SLURM=1`` (CI)
they fail.

What each test exercises, honestly:

* the time limit: the job starts with ``--time=5``; both ranks SIGSTOP themselves once they have
  trained 150 steps (an injected ``rank_hung`` fault each), so the run cannot finish before the
  test lowers the limit, however fast the machine. The test then lowers the limit to 1 minute
  (SLURM's minimum) with ``scontrol update``; the launcher re-reads EndTime every second here
  (``[slurm] end_time_refresh``) and writes ``slurm_end_time_changed`` with the ranks' new end
  time (EndTime − ``end_margin``, 50 s here). Once that moment has passed, the test continues the
  ranks (SIGCONT); their next stop check (every step here) sees the time limit, they save, exit 75,
  and the launcher requeues the job; the test then sets the limit back to 5 minutes and the
  requeued run finishes. SLURM's own ``--signal=B:USR1@N`` is not what stops it: SLURM sends that
  signal from a periodic check (up to ~60 s early or late on a 1-minute job), so the test sets
  N=1; the path that signal takes (batch shell → srun → launcher → ranks) is the one
  ``scancel --signal=USR1 --batch`` exercises below;
* ``scancel --signal=USR1 --batch``: the batch shell's trap → ``srun`` → ``trainguard run`` → ranks;
* ``scontrol requeue`` of the running job: SLURM's SIGTERM to every process of the job. For both,
  the ranks hold themselves (SIGSTOP) first, so the signal finds the job running on any machine;
  the test continues them once the launcher has received the signal.

Measured figures (signal → requeue, requeue → running again, lost steps) are printed (``-s``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import GPT, REPO, TINY, events, final_hash, pinned, sets, wait_for
from trainguard.slurm.info import parse_show_job

# one local cluster of one node: its tests run one after another (on one worker under pytest-xdist);
# marked slurm: scripts/test.sh leaves them out (its 15 minutes), scripts/test_slurm.sh runs them
pytestmark = [pytest.mark.xdist_group("slurm"), pytest.mark.slurm]

STEPS = 500  # the tiny GPT: ~15-40 ms a step on 2 CPU ranks (shared with the clean run of conftest)
TIMEOUT = 240  # seconds for any one job to finish, requeues included


def _cluster_problem() -> Optional[str]:
    """Why the local SLURM cluster cannot be used, or ``None`` when its node is up."""
    for cmd in ("sbatch", "sinfo", "scontrol", "scancel", "squeue"):
        if not shutil.which(cmd):
            return f"{cmd} is not on PATH"
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s (slurmctld down?)"
    states = proc.stdout.split()
    if proc.returncode != 0 or not states:
        return f"sinfo failed: {' '.join(proc.stderr.split()) or 'no nodes'}"
    if not any(s.rstrip("*~#").split("+")[0] in ("idle", "mixed", "allocated", "completing") for s in states):
        return f"no usable node (states: {', '.join(states)})"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster():
    problem = _cluster_problem()
    if problem is not None:
        if os.environ.get("TRAINGUARD_REQUIRE_SLURM") == "1":
            pytest.fail(f"TRAINGUARD_REQUIRE_SLURM=1 but the local SLURM cluster is not usable: {problem}")
        pytest.skip(f"no local SLURM cluster ({problem}); start one with: sudo bash scripts/slurm-up.sh")


@pytest.fixture
def jobs():
    """Job ids submitted by a test; whatever is left of them is cancelled afterwards."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30)


def tg_slurm(
    command: str, run_dir: Path, *options: str, overrides: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``trainguard slurm COMMAND --run-dir RUN_DIR OPTIONS --nproc-per-node 2 examples/gpt.py --set ...``"""
    cmd = [
        sys.executable,
        "-m",
        "trainguard.cli",
        "slurm",
        command,
        "--run-dir",
        str(run_dir),
        "--nproc-per-node",
        "2",
        *options,
        str(GPT),
        *sets(*TINY, *pinned(overrides)),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60)


def submit(jobs: list[str], run_dir: Path, *options: str, overrides: tuple[str, ...] = ()) -> str:
    proc = tg_slurm("submit", run_dir, *options, overrides=overrides)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split()[-1]
    jobs.append(job)
    return job


def job_tasks(job: str) -> list[dict[str, str]]:
    """``scontrol show job -o JOB``: one dict per job (per task for an array)."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    return [parse_show_job(line) for line in proc.stdout.splitlines() if line.strip()]


FINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


def wait_done(job: str, n_tasks: int = 1, timeout: float = TIMEOUT) -> list[dict[str, str]]:
    """Wait until the job (all ``n_tasks`` tasks of an array) reached a final state; return them."""

    def done():
        tasks = job_tasks(job)
        return tasks if len(tasks) == n_tasks and all(t.get("JobState") in FINAL for t in tasks) else None

    return wait_for(done, timeout=timeout, what=f"job {job} to end")


def output(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("slurm-*.out")))


def progress_step(run_dir: Path) -> int:
    """Highest step the run has shown (``step N/M`` lines of rank 0 in the job output)."""
    steps = [int(line.split()[1].split("/")[0]) for line in output(run_dir).splitlines() if line.startswith("step ")]
    return max(steps, default=0)


def restarts_seen(run_dir: Path) -> int:
    return max((e["details"]["restart_count"] for e in events(run_dir, "slurm_info")), default=-1)


def lost_steps(run_dir: Path) -> list[int]:
    """Per resume: the highest step any event showed before it minus the step it resumed from."""
    lost, high = [], 0
    for e in events(run_dir):
        if e["kind"] == "resume":
            lost.append(high - e["details"]["from_step"])
        elif e.get("step") is not None and e["rank"] is not None:
            high = max(high, e["step"])
    return lost


def requeue_timing(run_dir: Path) -> list[dict]:
    """For each successful ``slurm_requeue``: seconds from the requeue to the next launch's
    ``slurm_info`` (the job runs again) and to its ``resume`` (training continues)."""
    out, evs = [], events(run_dir)
    for i, e in enumerate(evs):
        if e["kind"] == "slurm_requeue" and e["details"].get("ok"):
            info = next((x for x in evs[i:] if x["kind"] == "slurm_info"), None)
            resume = next((x for x in evs[i:] if x["kind"] == "resume"), None)
            out.append(
                {
                    "running_after": info and round(info["time"] - e["time"], 2),
                    "resumed_after": resume and round(resume["time"] - e["time"], 2),
                }
            )
    return out


def held_ranks(*steps: int) -> tuple[str, ...]:
    """Overrides that make both ranks hold themselves (SIGSTOP) once they have trained each of
    ``steps`` steps, and check for a stop after every step (so a signal the test sends while they
    are held stops them in the step after SIGCONT)."""
    hold = ", ".join(f"{{kind='rank_hung', rank={r}, step={s}}}" for s in steps for r in (0, 1))
    return (
        "stop.check_interval=1",
        "supervisor.learn=false",  # the held ranks stay within the 180 s step timeout
        "supervisor.stopped_grace=0",  # and stopped (SIGSTOP) is not taken for a hang here
        f"faults.inject=[{hold}]",
    )


def _held(run: Path, n: int) -> list[dict]:
    """Wait until ``n`` ``fault_injected`` events are written (both ranks held, per launch); return them."""
    return wait_for(
        lambda: (lambda f: f if len(f) >= n else None)(events(run, "fault_injected")),
        timeout=TIMEOUT,
        what=f"{n} ranks held",
    )


def _signalled(run: Path, before: int) -> None:
    """Wait until the launcher has received (and forwarded) a signal after the ``before`` it had."""
    wait_for(lambda: len(events(run, "signal_received")) > before, timeout=60, what="a signal at the launcher")


def _cont(held: list[dict]) -> None:
    for f in held:
        try:
            os.kill(f["pid"], signal.SIGCONT)
        except ProcessLookupError:  # SLURM's SIGKILL after KillWait would have failed the test below
            pass


def test_time_limit_saves_before_end_time_requeues_and_matches_clean_run(tmp_path, jobs, clean_hash):
    run = tmp_path / "tl"
    job = submit(
        jobs,
        run,
        "--time",
        "5",
        "--signal-lead",
        "1",
        overrides=(
            f"train.max_steps={STEPS}",
            "checkpoint.interval=50",
            "slurm.end_time_refresh=1",
            "slurm.end_margin=50",
            *held_ranks(150),
        ),
    )
    held = _held(run, 2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=1"], check=True, timeout=30)
    changed = wait_for(lambda: events(run, "slurm_end_time_changed"), timeout=60, what="the new EndTime")[0]["details"]
    wait_for(lambda: time.time() > changed["ranks_end_time"], timeout=90, what="the ranks' new end time")
    _cont(held)
    wait_for(lambda: events(run, "slurm_requeue"), timeout=120, what="the requeue at the time limit")
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=5"], check=True, timeout=30)
    tasks = wait_done(job)
    assert tasks[0]["JobState"] == "COMPLETED" and tasks[0]["ExitCode"] == "0:0", output(run)[-3000:]
    assert tasks[0]["Restarts"] == "1"

    infos = events(run, "slurm_info")
    assert [(i["details"]["restart_count"], i["details"]["time_limit"]) for i in infos] == [(0, 300), (1, 300)]
    assert changed["time_limit"] == 60 and changed["end_time"] < infos[0]["details"]["end_time"]
    assert changed["ranks_end_time"] == changed["end_time"] - 50
    [stop] = events(run, "stop_requested")
    assert stop["details"]["reason"] == "time_limit" and stop["step"] in (150, 151)  # the first check after SIGCONT
    assert stop["step"] in [e["step"] for e in events(run, "checkpoint_committed")]
    exit_ = events(run, "launch_exit")[0]
    assert exit_["details"]["code"] == 75 and exit_["time"] < changed["end_time"]  # saved, left before SLURM's kill
    [requeue] = events(run, "slurm_requeue")
    assert requeue["details"]["ok"] and requeue["details"]["reason"] == "time_limit"
    assert requeue["time"] < changed["end_time"]
    assert lost_steps(run) == [0]
    assert final_hash(run) == clean_hash(STEPS)
    print(
        f"\n[time limit] stop at step {stop['step']}, {changed['end_time'] - exit_['time']:.1f} s before EndTime; "
        f"requeue timing {requeue_timing(run)}"
    )


def test_usr1_to_batch_shell_and_scontrol_requeue_resume_bitwise(tmp_path, jobs, clean_hash):
    # both ranks hold themselves (SIGSTOP) at step 150 in the first launch and at step 250 in the
    # second: each signal arrives while the job is running, however fast the machine (a 500-step
    # run could finish before the test's 'scontrol requeue'; CI saw it). The signal waits, pending,
    # in the stopped ranks; the test continues them once the launcher has forwarded it.
    run = tmp_path / "sig"
    job = submit(
        jobs,
        run,
        "--time",
        "5",
        overrides=(
            f"train.max_steps={STEPS}",
            "checkpoint.interval=50",
            *held_ranks(150, 250),
        ),
    )
    held = _held(run, 2)
    t_signal = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    _signalled(run, 0)
    _cont(held)
    requeued = wait_for(lambda: events(run, "slurm_requeue"), timeout=120, what="the requeue")[0]
    assert requeued["details"]["ok"] and requeued["details"]["requeue_id"] == job
    signal_to_requeue = requeued["time"] - t_signal
    stop = events(run, "stop_requested")[0]
    assert stop["details"]["reason"] == "signal" and stop["details"]["signal"] == "SIGUSR1"
    assert stop["step"] in (150, 151)

    held = _held(run, 4)[2:]
    assert restarts_seen(run) == 1 and len(events(run, "resume")) == 1
    t_requeue, before = time.time(), len(events(run, "signal_received"))
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    _signalled(run, before)
    _cont(held)
    wait_for(lambda: restarts_seen(run) == 2, timeout=120, what="restart 2")
    external_requeue_to_running = events(run, "slurm_info")[-1]["time"] - t_requeue

    tasks = wait_done(job)
    assert tasks[0]["JobState"] == "COMPLETED" and tasks[0]["Restarts"] == "2", output(run)[-3000:]
    stops = events(run, "stop_requested")
    assert [s["details"]["reason"] for s in stops] == ["signal", "signal"]
    # SLURM's own SIGTERM on 'scontrol requeue' (or the batch shell's forwarded USR1, a moment later)
    assert stops[1]["details"]["signal"] in ("SIGTERM", "SIGUSR1")
    assert stops[1]["step"] in (250, 251)
    # the launcher did not requeue again a job that SLURM was already requeueing
    assert [bool(r["details"]["ok"]) for r in events(run, "slurm_requeue")] == [True, False]
    assert "already requeued" in events(run, "slurm_requeue")[1]["details"]["skipped"]
    assert lost_steps(run) == [0, 0]
    assert final_hash(run) == clean_hash(STEPS)
    print(
        f"\n[USR1 + scontrol requeue] signal → requeue {signal_to_requeue:.2f} s; requeue → running "
        f"{requeue_timing(run)}; scontrol requeue → running {external_requeue_to_running:.2f} s; "
        f"lost steps {lost_steps(run)}; second stop by {stops[1]['details']['signal']}"
    )


def test_array_finished_run_and_kill_switch_burn_through(tmp_path, jobs):
    done_run, kill_run = tmp_path / "array", tmp_path / "killed"
    kill_run.mkdir()
    (kill_run / "KILL").touch()
    t0 = time.time()
    first = submit(jobs, done_run, "--time", "5", "--array", "3", overrides=("train.max_steps=150",))
    second = submit(jobs, kill_run, "--time", "5", "--array", "3", overrides=("train.max_steps=150",))
    done_tasks, kill_tasks = wait_done(first, 3), wait_done(second, 3)
    print(f"\n[arrays] both 3-task arrays ended after {time.time() - t0:.1f} s")

    assert [t["ExitCode"] for t in done_tasks] == ["0:0"] * 3, output(done_run)[-3000:]
    assert len(events(done_run, "start")) == 1 and len(events(done_run, "end")) == 1  # trained in task 1 only
    skipped = events(done_run, "already_finished")
    assert len(skipped) == 2
    assert [e["details"]["array_task_id"] for e in events(done_run, "slurm_info")] == ["1", "2", "3"]
    fast = [e["details"]["seconds"] for e in events(done_run, "launch_exit")[1:]]
    assert all(s < 15 for s in fast), fast
    assert len({e["details"]["state_sha256"] for e in events(done_run, "launch_exit")}) == 1

    assert [t["ExitCode"] for t in kill_tasks] == ["75:0"] * 3, output(kill_run)[-3000:]
    assert [e["details"]["reason"] for e in events(kill_run, "stop_requested")] == ["kill_switch"] * 3
    assert not events(kill_run, "start") and not events(kill_run, "slurm_requeue")
    assert len(events(kill_run, "slurm_requeue_declined")) == 3
    assert all(e["details"]["seconds"] < 5 for e in events(kill_run, "launch_exit"))  # no ranks started
    assert all(t["Restarts"] == "0" for t in kill_tasks)


def test_scancel_is_not_requeued(tmp_path, jobs):
    """A user's scancel looks like a time-limit kill from inside the job (SIGTERM, COMPLETING); the
    launcher tells them apart by run time vs. time limit and does not bring a cancelled job back."""
    run = tmp_path / "cancel"
    job = submit(jobs, run, "--time", "5", overrides=("train.max_steps=100000", "checkpoint.interval=500"))
    wait_for(lambda: events(run, "start"), timeout=TIMEOUT, what="training to start")
    subprocess.run(["scancel", job], check=True, timeout=30)
    [task] = wait_done(job)
    assert task["JobState"] == "CANCELLED" and task["Restarts"] == "0"
    [requeue] = wait_for(lambda: events(run, "slurm_requeue"), timeout=30, what="the requeue decision")
    assert not requeue["details"]["ok"] and "cancelled (scancel)" in requeue["details"]["skipped"]
    assert events(run, "stop_requested")[0]["details"]["signal"] == "SIGTERM"  # it still saved on the way out


@pytest.mark.skipif(os.environ.get("TRAINGUARD_SLURM_SLOW") != "1", reason="~2.5 min: set TRAINGUARD_SLURM_SLOW=1")
def test_time_limit_kill_without_signal_is_requeued(tmp_path, jobs):
    """SLURM's own SIGTERM at the time limit (no --signal, EndTime ignored): the ranks save, the
    launcher requeues the TIMEOUT job, and it resumes where it stopped (Lightning #20542)."""
    run = tmp_path / "kill"
    submit(
        jobs,
        run,
        "--time",
        "1",
        "--signal-lead",
        "0",
        overrides=(
            "train.max_steps=100000",
            "checkpoint.interval=500",
            "train.log_interval=100",
            "slurm.use_end_time=false",
        ),
    )
    assert "#SBATCH --signal" not in (run / "slurm-job.sh").read_text()
    wait_for(lambda: events(run, "resume"), timeout=200, what="the resume after the time limit")
    [stop] = events(run, "stop_requested")
    assert stop["details"]["signal"] == "SIGTERM"
    [requeue] = events(run, "slurm_requeue")
    assert requeue["details"]["ok"] and requeue["details"]["job_state"] != "RUNNING"
    assert lost_steps(run) == [0]
    print(
        f"\n[time-limit kill] SIGTERM at {stop['details']['signal_time'] - events(run, 'slurm_info')[0]['details']['start_time']:.1f} s "
        f"into a 60 s job; saved step {stop['step']}; state at requeue {requeue['details']['job_state']}; {requeue_timing(run)}"
    )


def test_a_persistent_corruption_is_requeued_without_its_node(tmp_path, jobs):
    """A bit of rank 1's replica flips after step 15 every time (a bad device): the check at step
    20 finds it twice, the ranks stop with 75 (reason sdc), the launcher requeues the job and sets
    the node in RUN_DIR/exclude_nodes as the pending job's ExcNodeList. The one-node test cluster
    then has nowhere to run it: it stays pending (the test cancels it)."""
    run = tmp_path / "sdc"
    job = submit(
        jobs,
        run,
        "--time",
        "5",
        overrides=(
            "train.max_steps=100",
            "checkpoint.interval=10",
            "sdc.check_interval=10",
            'faults.inject=[{kind="sdc", rank=1, step=15, persistent=true}]',
        ),
    )
    wait_for(lambda: events(run, "slurm_requeue"), timeout=TIMEOUT, what="the requeue after the sdc stop")
    [requeue] = events(run, "slurm_requeue")
    node = (run / "exclude_nodes").read_text().split()
    assert requeue["details"]["ok"] and requeue["details"]["reason"] == "sdc", requeue
    assert requeue["details"]["exclude_nodes"] == node and requeue["details"]["exclude_ok"], requeue
    [task] = wait_for(lambda: [t for t in job_tasks(job) if t.get("JobState") == "PENDING"], what="the job pending")
    assert task["ExcNodeList"] == node[0], task


def test_generated_script_passes_sbatch_test_only(tmp_path):
    run = tmp_path / "t"
    proc = tg_slurm(
        "script", run, "--time", "10", "--array", "4", "--partition", "debug", "-o", str(tmp_path / "job.sh")
    )
    assert proc.returncode == 0, proc.stderr
    test = subprocess.run(
        ["sbatch", "--test-only", str(tmp_path / "job.sh")], capture_output=True, text=True, timeout=30
    )
    assert test.returncode == 0 and "to start at" in test.stderr, test.stderr
    via_cli = tg_slurm("submit", run, "--time", "10", "--test-only")
    assert via_cli.returncode == 0 and "to start at" in via_cli.stdout, via_cli.stderr
    fewer = tg_slurm("submit", run, "--time", "10", "--nodes", "2", "--min-nodes", "1", "--test-only")
    assert fewer.returncode == 0 and "to start at" in fewer.stdout, fewer.stderr  # 1 of 2 nodes on this cluster


@pytest.mark.parametrize(
    "options, message",
    [
        (("--time", "1", "--signal-lead", "90"), "signal lead 90 s is not shorter than the time limit 60 s"),
        (("--time", "5", "--partition", "nosuch"), "unknown SLURM partition 'nosuch' (this cluster has: debug)"),
        (("--time", "in a while"), "is not a SLURM time"),
    ],
)
def test_bad_input_exits_2_before_submitting(tmp_path, options, message):
    run = tmp_path / "bad"
    proc = tg_slurm("submit", run, *options)
    assert proc.returncode == 2 and "trainguard: error:" in proc.stderr and message in proc.stderr, proc.stderr
    assert not (run / "slurm-job.sh").exists()
    # no job of this run directory (a requeued job of an earlier test may come and go meanwhile)
    queued = subprocess.run(["squeue", "-h", "-o", "%i %o %Z"], capture_output=True, text=True, timeout=30).stdout
    assert str(run) not in queued, queued
