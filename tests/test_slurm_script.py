"""The SLURM pieces that need no cluster: time parsing, SLURMInfo from the environment, the signal
lead from a run's events, the batch script's text (checked by bash), the requeue decision, the
finished marker, and the time limit from a job's end time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from trainguard.config import ConfigError, StopSection, load_config
from trainguard.events import EventLog
from trainguard.slurm import finished
from trainguard.slurm import script as sbatch
from trainguard.slurm.endtime import JobEndTime, write_end_time
from trainguard.slurm.info import SLURMInfo, parse_show_job, parse_slurm_time, parse_slurm_timestamp
from trainguard.slurm.requeue import ended_early, requeue_decision, stop_reasons
from trainguard.stop.conditions import StopConditions
from trainguard.stop.signals import ShutdownHandler

GPT = str(REPO / "examples" / "gpt.py")


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("10", 600),
        ("1:30", 90),
        ("01:00:00", 3600),
        ("2-3", 2 * 86400 + 3 * 3600),
        ("1-00:30", 86400 + 1800),
        ("1-02:03:04", 86400 + 7384),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_parse_slurm_time(text, seconds):
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "-5", "ten", "1-"])
def test_parse_slurm_time_rejects_malformed(text):
    with pytest.raises(ValueError, match="not a SLURM time"):
        parse_slurm_time(text)


def test_show_job_parsing_keeps_spaces_in_values_and_reads_timestamps():
    line = (
        "JobId=42 JobName=my job JobState=RUNNING Restarts=2 TimeLimit=00:01:00 "
        "StartTime=2026-01-02T03:04:05 EndTime=Unknown Command=/x/run.sh --a b Requeue=1"
    )
    fields = parse_show_job(line)
    assert fields["JobName"] == "my job" and fields["Command"] == "/x/run.sh --a b"
    assert fields["Restarts"] == "2" and fields["Requeue"] == "1"
    assert parse_slurm_timestamp(fields["StartTime"]) == time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    assert parse_slurm_timestamp(fields["EndTime"]) is None


def test_slurm_info_from_environment():
    assert SLURMInfo.from_env({}, query=False) is None
    env = {
        "SLURM_JOB_ID": "107",
        "SLURM_ARRAY_JOB_ID": "100",
        "SLURM_ARRAY_TASK_ID": "7",
        "SLURM_JOB_NODELIST": "n[01-04]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_RESTART_COUNT": "3",
        "SLURM_JOB_PARTITION": "gpu",
    }
    info = SLURMInfo.from_env(env, query=False)
    assert (info.job_id, info.num_nodes, info.node_id, info.restart_count) == ("107", 4, 2, 3)
    assert info.requeue_id == "100_7"  # scontrol requeue needs the array form
    assert SLURMInfo.from_env({"SLURM_JOB_ID": "9"}, query=False).requeue_id == "9"
    event = info.to_event()
    assert event["restart_count"] == 3 and event["requeue_id"] == "100_7"


def test_slurm_info_records_why_scontrol_could_not_be_asked():
    info = SLURMInfo.from_env({"SLURM_JOB_ID": "9"}, scontrol="/nonexistent/scontrol")
    assert info.end_time is None and "/nonexistent/scontrol" in info.query_error


def _events(run_dir: Path, *items: tuple[str, dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = EventLog(run_dir, rank=0)
    for kind, details in items:
        log.emit(kind, 1, **details)
    log.close()


def test_signal_lead_from_measured_step_and_save_times(tmp_path):
    lead, basis = sbatch.signal_lead(tmp_path / "none")
    assert lead == sbatch.DEFAULT_LEAD and "no measured" in basis
    _events(
        tmp_path,
        ("progress", {"step_seconds": 2.0}),
        ("progress", {"step_seconds": 4.0}),
        ("checkpoint_committed", {"seconds": 30.0}),
        ("checkpoint_committed", {"seconds": 10.0}),
    )
    lead, basis = sbatch.signal_lead(tmp_path)
    # 2 × (check 1 s + 2 × slowest step 4 s + slowest save 30 s + exit 15 s) = 108 s
    assert lead == 108 and "step 4.000 s" in basis and "save 30.000 s" in basis
    fast = tmp_path / "fast"
    _events(fast, ("progress", {"step_seconds": 0.01}))
    assert sbatch.signal_lead(fast)[0] == 33  # ceil(2 × (1 + 0.02 + 15)): the exit time dominates


def _opts(tmp_path: Path, **kw) -> sbatch.ScriptOptions:
    base = dict(
        script=GPT,
        run_dir=tmp_path / "run",
        script_args=["--set", "train.max_steps=5"],
        launcher_sets=["slurm.auto_requeue=true"],
        nproc_per_node=2,
        time="30",
        signal_lead=90,
    )
    return sbatch.ScriptOptions(**{**base, **kw})


def test_script_text_has_signal_requeue_and_srun_and_is_valid_bash(tmp_path):
    text = sbatch.render(_opts(tmp_path))
    for line in (
        "#SBATCH --signal=B:USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --time=30",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
    ):
        assert line in text.splitlines(), line
    assert "trap 'pending=USR1" in text and "trap 'pending=TERM" in text
    assert 'kill -USR1 "$srun_pid"' in text and 'exit "$rc"' in text
    assert "--nproc-per-node 2" in text and "--set slurm.auto_requeue=true" in text
    assert "--rdzv-endpoint" not in text  # one node: standalone rendezvous
    path = tmp_path / "job.sh"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_script_with_min_nodes_runs_on_what_slurm_allocates(tmp_path):
    text = sbatch.render(_opts(tmp_path, nodes=4, min_nodes=2))
    assert "#SBATCH --nodes=2-4" in text.splitlines()
    assert 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES"' in text
    assert '--nnodes "$SLURM_JOB_NUM_NODES"' in text and '--rdzv-endpoint "$head_node:29500"' in text
    path = tmp_path / "job.sh"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert "#SBATCH --nodes=4" in sbatch.render(_opts(tmp_path, nodes=4, min_nodes=4)).splitlines()
    with pytest.raises(ConfigError, match="--min-nodes must be between 1 and --nodes \\(4\\), got 5"):
        sbatch.validate(_opts(tmp_path, nodes=4, min_nodes=5), check_cluster=False)


def test_script_with_spare_nodes_allocates_them_and_starts_their_launchers_as_spares(tmp_path):
    text = sbatch.render(_opts(tmp_path, nodes=2, spare_nodes=1))
    assert "#SBATCH --nodes=3" in text.splitlines()
    assert "srun --nodes=3 --ntasks=3 --ntasks-per-node=1" in text and "--nnodes 2:3" in text
    assert '--rdzv-endpoint "$head_node:29500"' in text  # one node and one spare is a multi-node job
    assert "--nnodes 1:2" in sbatch.render(_opts(tmp_path, nodes=1, spare_nodes=1))
    path = tmp_path / "job.sh"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_script_for_several_nodes_array_and_dependency(tmp_path):
    text = sbatch.render(_opts(tmp_path, nodes=4, gres="gpu:8", cpus_per_task=32, array=5, partition="p"))
    assert '--rdzv-endpoint "$head_node:29500"' in text and "--nnodes 4" in text
    assert "#SBATCH --array=1-5%1" in text and "slurm-%A_%a.out" in text
    assert "#SBATCH --gres=gpu:8" in text and "srun --nodes=4 --ntasks=4 --ntasks-per-node=1" in text
    assert "--cpus-per-task=32" in text.split("srun", 1)[1]  # srun ≥ 22.05 does not inherit it
    assert "#SBATCH --dependency=afterany:77" in sbatch.render(_opts(tmp_path, after="77"))
    no_signal = _opts(tmp_path, signal_lead=0, time="1")
    sbatch.validate(no_signal, check_cluster=False)  # 0: no --signal, so no conflict with a 1-minute limit
    assert "#SBATCH --signal" not in sbatch.render(no_signal)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(time="1", signal_lead=60), "not shorter than the time limit"),
        (dict(time="1:00:00:00"), "not a SLURM time"),
        (dict(array=0), "--array must be"),
        (dict(array=2, after="5"), "do not go together"),
        (dict(after="abc"), "expected a SLURM job id"),
        (dict(script="/nonexistent.py"), "does not exist"),
        (dict(signal_lead=70000), "1 to 65535"),
        (dict(spare_nodes=-1), "--spare-nodes must be"),
        (dict(nodes=4, min_nodes=2, spare_nodes=1), "--spare-nodes and --min-nodes do not go together"),
    ],
)
def test_validate_rejects_bad_input(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        sbatch.validate(_opts(tmp_path, **kw), check_cluster=False)


def test_cli_bad_time_exits_2_with_a_clear_message(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard.cli",
            "slurm",
            "script",
            "--run-dir",
            str(tmp_path / "r"),
            "--time",
            "soon",
            GPT,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "trainguard: error: --time: time 'soon' is not a SLURM time" in proc.stderr
    assert proc.stdout == ""


def test_slurm_section_rejects_malformed_time():
    with pytest.raises(ConfigError, match="slurm.time"):
        load_config(None, ["slurm.time=tomorrow"])


def test_requeue_decision():
    assert requeue_decision(75, {"time_limit"}, None) == (True, "time_limit")
    assert requeue_decision(75, set(), "SIGTERM")[0] is True
    assert requeue_decision(75, {"memory", "straggler"}, None)[0] is True
    assert requeue_decision(75, {"kill_switch"}, None) == (False, "stopped by the kill switch")
    assert requeue_decision(0, set(), None)[0] is False and requeue_decision(76, {"signal"}, None)[0] is False
    assert requeue_decision(75, set(), None) == (True, "exit code 75 (no stop reason recorded)")


def test_requeue_decision_reads_this_launchs_events_and_the_kill_switch(tmp_path):
    _events(tmp_path, ("exit", {"code": 75, "reason": "kill_switch"}))
    since = time.time()
    _events(tmp_path, ("stop_requested", {"reason": "time_limit"}), ("exit", {"code": 75, "reason": "time_limit"}))
    assert stop_reasons(tmp_path, since) == {"time_limit"}
    kill = tmp_path / "KILL"
    assert requeue_decision(75, stop_reasons(tmp_path, since), None, kill)[0] is True
    kill.touch()
    assert requeue_decision(75, stop_reasons(tmp_path, since), None, kill)[0] is False


def test_a_job_ending_before_its_time_limit_was_cancelled():
    # what scontrol shows while the job's processes are being killed: EndTime is the kill time
    cancelled = {
        "JobState": "COMPLETING",
        "StartTime": "2026-11-23T07:25:51",
        "EndTime": "2026-11-23T07:25:53",
        "TimeLimit": "00:05:00",
    }
    assert "cancelled (scancel)" in ended_early(cancelled)
    timed_out = dict(cancelled, EndTime="2026-11-23T07:30:51")
    assert ended_early(timed_out) is None
    assert ended_early(dict(cancelled, JobState="RUNNING")) is None


def test_finished_marker_signature(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[checkpoint]\ninterval = 5\n")
    sig = finished.signature(GPT, ["--set", "train.max_steps=5"], [], str(cfg))
    assert sig == finished.signature(GPT, ["--set", "train.max_steps=5"], [], str(cfg))
    assert sig != finished.signature(GPT, ["--set", "train.max_steps=6"], [], str(cfg))
    cfg.write_text("[checkpoint]\ninterval = 6\n")
    assert sig != finished.signature(GPT, ["--set", "train.max_steps=5"], [], str(cfg))
    finished.write(tmp_path, sig, "abc", slurm_job_id="3")
    assert finished.read(tmp_path)["signature"] == sig and finished.read(tmp_path)["state_sha256"] == "abc"
    assert finished.read(tmp_path / "missing") is None


def test_time_left_is_the_earlier_of_max_duration_and_the_job_end(tmp_path, monkeypatch):
    shutdown = ShutdownHandler([], deadline=60.0)
    now = time.time()
    assert StopConditions(StopSection(), tmp_path, shutdown, start_time=now).time_left() is None
    by_end = StopConditions(StopSection(), tmp_path, shutdown, start_time=now, end_time=now + 100).time_left()
    assert 99 < by_end <= 100
    both = StopConditions(StopSection(max_duration=50), tmp_path, shutdown, start_time=now, end_time=now + 100)
    assert 49 < both.time_left() <= 50
    monkeypatch.setenv("TRAINGUARD_END_TIME", repr(now + 30))  # what trainguard run sets under SLURM
    assert 29 < StopConditions(StopSection(max_duration=50), tmp_path, shutdown, start_time=now).time_left() <= 30
    flags = StopConditions(StopSection(time_margin=40), tmp_path, shutdown, start_time=now).local_flags(0.1, 1.0)
    assert flags.time_limit == 1  # the time-limit flag: 30 s left < 2 steps + save + 40 s margin


def test_ranks_follow_the_end_time_file_when_it_changes(tmp_path):
    path = tmp_path / ".slurm_end_time.7.0"
    env = {"TRAINGUARD_END_TIME": "1000.5", "TRAINGUARD_END_TIME_FILE": str(path)}
    reader = JobEndTime(env)
    assert reader.get() == 1000.5  # no file yet: the environment's value
    write_end_time(path, 2000.0)
    assert reader.get() == 2000.0
    time.sleep(0.01)
    write_end_time(path, None)  # the limit was lifted
    assert reader.get() is None
    assert JobEndTime({}).get() is None


@pytest.mark.soak  # moved out of the README suite to keep it under 15 min on 2 cores; CI runs it in the soak step
def test_finished_run_makes_a_relaunch_exit_at_once(tmp_path):
    """A launch of the same command on a finished run dir exits 0 without starting ranks (job arrays)."""
    from conftest import events, finish, launch

    run = tmp_path / "run"
    assert finish(launch(run, "train.max_steps=5")) == 0
    marker = json.loads((run / "FINISHED").read_text())
    t0 = time.monotonic()
    assert finish(launch(run, "train.max_steps=5")) == 0
    assert time.monotonic() - t0 < 30
    assert len(events(run, "start")) == 1 and events(run, "already_finished")
    last = events(run, "launch_exit")[-1]["details"]
    assert last["reason"] == "already finished" and last["state_sha256"] == marker["state_sha256"]
    # another command (more steps) trains on from the final checkpoint
    assert finish(launch(run, "train.max_steps=8")) == 0
    assert events(run, "finished_marker_ignored") and events(run, "resume")[-1]["details"]["from_step"] == 5


INJECTED = "x\ntouch pwned"


def _control_case(tmp_path: Path, option: str, char: str) -> tuple[list[str], str]:
    """The ``trainguard slurm script`` arguments that put ``char`` into the value of ``option``,
    and the option's name in the refusal."""
    value = INJECTED.replace("\n", char)
    run = str(tmp_path / "run")
    script = str(REPO / "examples" / "gpt.py")
    if option == "--run-dir":
        return ["--run-dir", str(tmp_path / value), script], "--run-dir"
    if option == "sbatch_args":
        sets = "slurm.sbatch_args=[" + json.dumps(f"--mem=1G{char}touch pwned") + "]"
        return ["--run-dir", run, "--set", sets, script], "[slurm] sbatch_args"
    if option == "--set":
        return ["--run-dir", run, "--set", f"slurm.job_name={json.dumps(value)}", script], "--job-name"
    if option == "script":
        odd = tmp_path / f"train{char}touch pwned.py"
        odd.write_text("print('hi')\n")
        return ["--run-dir", run, str(odd)], "the training script"
    if option == "script argument":
        return ["--run-dir", run, script, "--data", value], "a script argument"
    return ["--run-dir", run, option, value, script], option


@pytest.mark.parametrize(
    "option",
    ["--job-name", "--gres", "--partition", "--time", "--after", "--run-dir", "sbatch_args", "--set", "script"]
    + ["script argument"],
)
@pytest.mark.parametrize("char", ["\n", "\r", "\x1b"])
def test_slurm_script_refuses_control_characters_in_every_value_naming_the_option(tmp_path, option, char):
    """``trainguard slurm script --job-name $'x\\ntouch pwned' ...`` wrote ``touch pwned`` as a line
    of its own: every value the script is made of is refused with a control character in it
    (exit code 2, the option named), and no script is written."""
    args, name = _control_case(tmp_path, option, char)
    out = tmp_path / "job.sh"
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "slurm", "script", "--output", str(out), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert name in done.stderr and f"holds the control character {char!r}" in done.stderr, done.stderr
    assert not out.exists() and "touch pwned" not in done.stdout


def test_nul_and_del_are_refused_too(tmp_path):
    for char in ("\x00", "\x7f", "\t"):
        with pytest.raises(ConfigError, match=r"--gres \(or \[slurm\] gres\) .*holds the control character"):
            sbatch.validate(_opts(tmp_path, gres=f"gpu:8{char}x"), check_cluster=False)
    assert sbatch.validate(_opts(tmp_path, gres="gpu:8", job_name="nächster-lauf"), check_cluster=False) == []


def test_each_sbatch_value_stays_one_word_of_its_line(tmp_path):
    """Issue 54: ``#SBATCH`` values were written unquoted, and sbatch splits an ``#SBATCH`` line
    into words as a shell does (quotes, backslashes, ``#`` starts a comment): ``--job-name 'jn
    --output=/x'`` became two options. Now each value is one word (quoted where it must be)."""
    import shlex

    opts = _opts(tmp_path, job_name="jn --output=/x #c", sbatch_args=["--comment=a b"])
    lines = [line for line in sbatch.render(opts).splitlines() if line.startswith("#SBATCH ")]
    words = [shlex.split(line[len("#SBATCH ") :], comments=True) for line in lines]
    assert all(len(w) == 1 for w in words), lines
    assert ["--job-name=jn --output=/x #c"] in words and ["--comment=a b"] in words
    assert "#SBATCH --requeue" in lines  # a plain value is written as before
