"""`trainguard report`: goodput, incidents, checkpoint costs and Young/Daly from a real chaos run
(an injected rank kill, a SIGTERM to the launcher and a relaunch, an injected SIGSTOP hang on 2
gloo ranks), from hand-made event logs with known answers, and from broken run directories."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, events, finish, launch, logged_step, wait_for
from trainguard.report import ReportError, build_report, daly_interval, load_events, main, render_text, young_interval

# one worker under pytest-xdist runs this module, so that the chaos run (a session fixture) runs once
pytestmark = pytest.mark.xdist_group("report")

# the relaunch injects its hang a little after the step the SIGTERM stopped at: max_steps leaves room
# without the just-in-time save: the report's accounting of redone work needs restarts from an older
# checkpoint (with it, the restarts here redo nothing: tests/test_jit.py)
COMMON = ("train.max_steps=300", "checkpoint.interval=10", "supervisor.step_timeout=3", "checkpoint.jit.enabled=false")


def log_of(run: Path) -> str:
    return Path(f"{run}.log").read_text(errors="replace")[-4000:]


@pytest.fixture(scope="session")  # session: xdist may interleave modules, which tears a module fixture down
def chaos(tmp_path_factory) -> Path:
    """Launch 1: rank 1 SIGKILLs itself at step 25 (the group restarts from step 20), then SIGTERM
    to the launcher (save, exit 75). Launch 2: rank 0 SIGSTOPs itself 15 to 25 steps after the stop step
    (the supervisor finds it stopped within a second, the group restarts), then it finishes.
    Faults fire in a launch's first worker group only, hence the hang in the second launch."""
    run = tmp_path_factory.mktemp("report") / "run"
    proc = launch(run, *COMMON, extra=("--inject", "rank_killed:rank=1,step=25"))
    wait_for(lambda: any(e["attempt"] == 1 for e in events(run, "start")), what="the restarted group's start")
    wait_for(lambda: logged_step(run) >= 45, what="step 45 after the restart")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 75, log_of(run)
    stop = events(run, "stop_requested")[-1]["step"]
    hang = (stop // 10 + 2) * 10 + 5  # between two checkpoints
    code = finish(launch(run, *COMMON, extra=("--inject", f"rank_hung:rank=0,step={hang},hang=sigstop")))
    assert code == 0, log_of(run)
    return run


def next_after(evs: list[dict], kind: str, t: float) -> dict:
    return next(e for e in evs if e["kind"] == kind and e["time"] > t)


@pytest.mark.soak  # the chaos run: a minute of the README suite's 15
def test_chaos_run_incidents_match_the_events(chaos):
    evs, malformed = load_events(chaos)
    assert malformed == 0
    report = build_report(evs)
    faults = {e["details"]["fault"]: e for e in evs if e["kind"] == "fault_injected"}
    stops = [e for e in evs if e["kind"] == "stop_requested"]
    hang_restarts = [e for e in evs if e["kind"] == "group_restart" and e["details"]["reason"].startswith("hang")]
    assert set(faults) == {"rank_killed", "rank_hung"} and len(stops) == len(hang_restarts) == 1
    assert report["incident_counts"] == {"rank_killed": 1, "preemption_signal": 1, "hang": 1}, report["incidents"]

    failure_step = {
        "rank_killed": faults["rank_killed"]["step"],
        "hang": faults["rank_hung"]["step"],
        "preemption_signal": stops[0]["step"],
    }
    for inc in report["incidents"]:
        kind = inc["kind"]
        assert inc["injected"] is (kind != "preemption_signal"), inc
        resumed = next_after(evs, "resume", inc["detected_time"])["details"]["from_step"]
        assert inc["step"] == failure_step[kind] and not inc["step_estimated"], inc
        # max(0, ...): the SIGCONT that lets a stopped rank dump its stack can let it finish one
        # more checkpoint before it is killed, so the resume can start past the injected step
        assert inc["resumed_from_step"] == resumed and inc["steps_lost"] == max(0, failure_step[kind] - resumed), inc
        start = next_after(evs, "start", inc["detected_time"])
        assert inc["recovered"] and inc["time_to_recover"] == pytest.approx(
            start["time"] - inc["detected_time"], abs=2e-3
        )
        if inc["injected"]:
            fault = faults["rank_killed" if kind == "rank_killed" else "rank_hung"]
            assert inc["detection_latency"] == pytest.approx(inc["detected_time"] - fault["time"], abs=2e-3)
            assert inc["detection_latency"] > 0
    hang = next(i for i in report["incidents"] if i["kind"] == "hang")
    # a stopped rank is hung once the launcher has seen it stopped for [supervisor] stopped_grace
    assert 0.3 <= hang["detection_latency"] < 2.0, hang  # before the learned step timeout (≥ 2 s, min_timeout)
    assert hang["ranks"][0] == 0
    assert report["steps_lost"] == sum(i["steps_lost"] for i in report["incidents"])


@pytest.mark.soak  # the chaos run: a minute of the README suite's 15
def test_chaos_run_goodput_checkpoints_and_interval(chaos):
    evs, _ = load_events(chaos)
    report = build_report(evs)
    assert (
        report["launches"] == 2 and report["attempts"] == len([e for e in evs if e["kind"] == "workers_started"]) == 4
    )
    assert report["status"] == "finished" and report["exit_code"] == 0 and report["final_step"] == 300
    wall = max(e["time"] for e in evs) - min(e["time"] for e in evs)
    assert report["wall_seconds"] == pytest.approx(wall, abs=1e-3)
    assert 0 < report["goodput"] < 1
    parts = report["time_breakdown"]
    assert set(parts) == {"productive", "restart_overhead", "redone_work", "checkpoint_stalls", "other"}
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) == pytest.approx(wall, rel=0.01)
    assert report["goodput"] == pytest.approx(parts["productive"] / wall, abs=1e-3)
    # three group starts after the first, each several seconds of process start-up
    assert parts["restart_overhead"] > parts["productive"] and parts["redone_work"] > 0

    committed = [e for e in evs if e["kind"] == "checkpoint_committed"]
    ckpt = report["checkpoints"]
    assert ckpt["count"] == len(committed) and ckpt["interval_steps"] == 10
    assert ckpt["save_seconds"]["total"] == pytest.approx(sum(e["details"]["seconds"] for e in committed), abs=1e-3)
    blocked = sum(e["details"]["blocked_seconds"] for e in committed)  # a background save: its snapshot
    assert ckpt["blocked_seconds"]["total"] == pytest.approx(blocked, abs=1e-3)
    assert parts["checkpoint_stalls"] == pytest.approx(blocked, abs=1e-3)
    assert ckpt["failures"] == len([e for e in evs if e["kind"] == "checkpoint_failed"])

    iv = report["checkpoint_interval"]
    assert iv["failures"] == 2 and iv["mtbf_seconds"] == pytest.approx(wall / 2, rel=1e-3)
    c = ckpt["blocked_seconds"]["median"]  # the cost of a save to training
    assert iv["young_seconds"] == pytest.approx(math.sqrt(2 * c * wall / 2), rel=1e-2)
    assert iv["young_steps"] == pytest.approx(iv["young_seconds"] / iv["seconds_per_step"], rel=1e-3)
    assert iv["used_steps"] == 10 and iv["daly_seconds"] < iv["young_seconds"]
    text = render_text(report)
    assert "Goodput" in text and "hang" in text and "rank_killed" in text and "Young" in text


@pytest.mark.soak  # the chaos run: a minute of the README suite's 15
def test_main_writes_text_json_and_png(chaos, tmp_path, capsys):
    assert main(chaos) == 0
    out, err = capsys.readouterr()
    assert "Goodput:" in out and "Incidents: 3 (2 injected)" in out and "trainguard:" not in err
    png = chaos / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    other = tmp_path / "timeline.png"
    assert main(chaos, as_json=True, png=other) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["incident_counts"]["hang"] == 1 and report["malformed_lines"] == 0
    assert other.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.soak  # the chaos run: a minute of the README suite's 15
def test_malformed_lines_are_skipped_counted_and_warned(chaos, tmp_path, capsys):
    run = tmp_path / "broken"
    run.mkdir()
    good = (chaos / "events.jsonl").read_text()
    lines = good.splitlines(keepends=True)
    # a line that is not JSON in the middle, and a line cut short by a crash at the end
    text = "".join(lines[:3]) + "{not json\n" + "".join(lines[3:]) + lines[5][: len(lines[5]) // 2]
    (run / "events.jsonl").write_text(text)
    bad = [4, len(lines) + 2]

    with pytest.warns(UserWarning, match=f"skipped 2 malformed event lines \\(lines {bad[0]}, {bad[1]}\\)"):
        evs, malformed = load_events(run)
    assert malformed == 2 and len(evs) == len(lines)
    assert build_report(evs)["incident_counts"] == build_report(load_events(chaos)[0])["incident_counts"]

    assert main(run, as_json=True, png=tmp_path / "x.png") == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["malformed_lines"] == 2
    assert f"trainguard: warning: skipped 2 malformed event lines (lines {bad[0]}, {bad[1]})" in err


def run_main(path: Path) -> subprocess.CompletedProcess:
    code = "import sys; from pathlib import Path; from trainguard.report import main; sys.exit(main(Path(sys.argv[1])))"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_missing_or_unusable_run_dir_exits_2_without_traceback(tmp_path, capsys):
    missing = tmp_path / "nope"
    done = run_main(missing)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"trainguard: error: run directory {missing} does not exist"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(empty) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainguard: error: ") and str(empty / "events.jsonl") in err and "does not exist" in err

    (empty / "events.jsonl").write_text("\n{oops\n")
    assert main(empty) == 2
    err = capsys.readouterr().err
    assert "skipped 1 malformed event line (line 2)" in err and "has no events" in err

    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(a_file) == 2 and "is not a directory" in capsys.readouterr().err
    with pytest.raises(ReportError, match="does not exist"):
        load_events(missing)

    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked"
        locked.mkdir()
        (locked / "events.jsonl").write_text("{}\n")
        locked.chmod(0)
        try:
            done = run_main(locked)
        finally:
            locked.chmod(0o755)
        assert done.returncode == 2 and "Traceback" not in done.stderr and "cannot be read" in done.stderr
    for done in (run_main(missing), run_main(a_file)):
        assert "Traceback" not in done.stderr


def test_young_and_daly_intervals():
    c, m = 10.0, 3600.0
    assert young_interval(c, m) == pytest.approx(268.33, abs=0.01)
    x = c / (2 * m)
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert daly_interval(c, m) == pytest.approx(expected, rel=1e-12)
    assert daly_interval(c, m) == pytest.approx(261.70, abs=0.01)
    assert daly_interval(100.0, 40.0) == 40.0  # C >= 2M: checkpoint every M
    with pytest.raises(ValueError):
        young_interval(1.0, 0.0)


def ev(t: float, kind: str, step=None, rank=0, attempt=0, **details) -> dict:
    return {
        "time": 1000.0 + t,
        "rank": rank,
        "kind": kind,
        "step": step,
        "attempt": attempt,
        "pid": 1,
        "details": details,
    }


@pytest.mark.parametrize(
    ("codes", "stopped", "ranks"),
    [
        ({"0": -9, "1": -9}, [0], [1]),  # the launcher SIGKILLed rank 0 because rank 1 had died
        ({"0": 1, "1": -9}, [], [1]),  # rank 0 failed in its next collective: a reaction to the kill
        ({"0": 1, "1": 1}, [], [0, 1]),  # a crash on both: both named
    ],
)
def test_a_failure_names_the_rank_that_failed_not_its_peers(codes, stopped, ranks):
    log = [
        ev(0, "launch", rank=None),
        ev(1, "workers_started", rank=None, restart=0),
        ev(10, "start", 0, first_step=0, resumed_from=None),
        ev(35, "workers_failed", rank=None, exit_codes=codes, stopped_by_launcher=stopped),
        ev(35, "group_restart", rank=None, reason="rank failure"),
        ev(35.5, "workers_started", rank=None, restart=1),
        ev(40, "start", 0, attempt=1, first_step=0, resumed_from=None),
        ev(60, "end", 20, attempt=1, state_sha256="x"),
        ev(62, "launch_exit", rank=None, code=0, reason="finished", seconds=62),
    ]
    (inc,) = build_report(log)["incidents"]
    assert inc["ranks"] == ranks and inc["kind"] == ("rank_killed" if ranks == [1] else "rank_crashed")


def test_goodput_breakdown_of_a_known_timeline():
    """A crash no fault injection announced: its step comes from the step rate (1 s a step)."""
    log = [
        ev(0, "launch", rank=None),
        ev(1, "workers_started", rank=None, restart=0),
        ev(10, "start", 0, first_step=0, resumed_from=None),
        ev(20, "checkpoint_committed", 10, bytes=100, seconds=1.0, reason="interval"),
        ev(35, "workers_failed", rank=None, exit_codes={"0": -9, "1": -9}),
        ev(35, "group_restart", rank=None, reason="rank failure"),
        ev(35.5, "workers_started", rank=None, restart=1),
        ev(39.9, "resume", 10, attempt=1, from_step=10, seconds=0.5),
        ev(40, "start", 10, attempt=1, first_step=10, resumed_from="step-10"),
        ev(60, "end", 30, attempt=1, state_sha256="x"),
        ev(62, "launch_exit", rank=None, code=0, reason="finished", seconds=62),
    ]
    report = build_report(log)
    (inc,) = report["incidents"]
    assert inc["kind"] == "rank_killed" and not inc["injected"] and inc["detection_latency"] is None
    assert inc["step"] == 25 and inc["step_estimated"] and inc["resumed_from_step"] == 10 and inc["steps_lost"] == 15
    assert inc["time_to_recover"] == 5.0 and inc["redone_seconds"] == pytest.approx(15.0)
    assert report["time_breakdown"] == pytest.approx(
        {"productive": 29.0, "restart_overhead": 5.0, "redone_work": 15.0, "checkpoint_stalls": 1.0, "other": 12.0}
    )
    assert report["goodput"] == pytest.approx(29 / 62, abs=1e-4)
    assert report["checkpoint_interval"]["mtbf_seconds"] == 62.0
    assert report["checkpoint_interval"]["young_seconds"] == pytest.approx(math.sqrt(2 * 1.0 * 62.0), rel=1e-4)


def test_a_lost_node_replaced_by_a_spare_node_is_an_in_process_incident():
    """The leading node's launcher finds node 1 silent for 1.5 s and a spare node takes its ranks:
    one ``node_lost`` incident, recovered in-process, nothing redone."""
    log = [
        ev(0, "launch", rank=None),
        ev(1, "workers_started", rank=None, restart=0),
        ev(10, "start", 0, first_step=0, resumed_from=None),
        ev(35, "recovery_started", 26, during="run_step"),
        ev(36.5, "node_lost", rank=None, node=1, host="h1", ranks=[2, 3], silent_seconds=1.5, spare_nodes=1),
        ev(36.5, "recovery_started", rank=None, generation=1, ranks=[2, 3], warm=[2, 3], host="h9"),
        ev(36.5, "spare_node_assigned", rank=None, node=1, host="h9", ranks=[2, 3], generation=1, spare=1),
        ev(37.5, "recovery_finished", 25, generation=1, replaced=[2, 3], seconds=2.5, steps_lost=0, redo_step=26),
        ev(60, "end", 50, state_sha256="x"),
        ev(61, "launch_exit", rank=None, code=0, reason="finished", seconds=61),
    ]
    report = build_report(log)
    (inc,) = report["incidents"]
    assert inc["kind"] == "node_lost" and inc["in_process"] and inc["ranks"] == [2, 3]
    assert inc["steps_lost"] == 0 and inc["time_to_recover"] == pytest.approx(1.0)  # from its detection
    assert report["failure_recovery"]["in_process"]["count"] == 1


def test_a_sharded_models_rollback_to_its_snapshot_counts_the_steps_trained_again():
    """FSDP2: rank 1 lost in step 38 (37 completed); every rank rolls back to the snapshot of step
    30, the replacement's shard from rank 0's copy: the incident is in-process, resumed at 30, with
    7 steps lost, and says where the shard came from."""
    log = [
        ev(0, "launch", rank=None),
        ev(1, "workers_started", rank=None, restart=0),
        ev(10, "start", 0, first_step=0, resumed_from=None),
        ev(35, "workers_failed", rank=None, exit_codes={"1": -9}),
        ev(35, "recovery_started", rank=None, generation=1, ranks=[1], warm=[1]),
        ev(35.4, "snapshot_restored", 30, rank=0, source="own memory", bytes=0, from_step=37),
        ev(35.4, "snapshot_restored", 30, rank=1, source="rank 0's memory", bytes=4096, from_step=None),
        ev(35.5, "recovery_finished", 30, generation=1, replaced=[1], seconds=0.5, steps_lost=7, redo_step=None),
        ev(60, "end", 60, state_sha256="x"),
        ev(61, "launch_exit", rank=None, code=0, reason="finished", seconds=61),
    ]
    report = build_report(log)
    (inc,) = report["incidents"]
    assert inc["in_process"] and inc["resumed_from_step"] == 30 and inc["steps_lost"] == 7, inc
    assert "snapshot of step 30, rank 1's shard from rank 0's memory" in inc["reason"]


def test_in_process_recovery_is_counted_apart_from_group_restarts():
    """A rank killed at step 25 and replaced in-process (the segment goes on, nothing is redone),
    then a kill recovered by a group restart from step 40's checkpoint."""
    log = [
        ev(0, "launch", rank=None),
        ev(1, "workers_started", rank=None, restart=0),
        ev(10, "start", 0, first_step=0, resumed_from=None),
        ev(34.9, "fault_injected", 25, rank=1, fault="rank_killed"),
        ev(35, "recovery_started", 26, during="run_step"),
        ev(35.1, "workers_failed", rank=None, exit_codes={"1": -9}),
        ev(35.1, "recovery_started", rank=None, generation=1, ranks=[1], warm=[1]),
        ev(35.9, "recovery_finished", 25, generation=1, replaced=[1], seconds=0.9, steps_lost=0, redo_step=26),
        ev(40, "checkpoint_committed", 40, bytes=100, seconds=0.1, reason="interval"),
        ev(45, "workers_failed", rank=None, exit_codes={"1": -9}),
        ev(45, "recovery_fallback", rank=None, reason="in-process replacement budget spent (1)"),
        ev(45, "group_restart", rank=None, reason="rank failure"),
        ev(45.5, "workers_started", rank=None, restart=1),
        ev(50, "start", 40, attempt=1, first_step=40, resumed_from="step-40"),
        ev(60, "end", 50, attempt=1, state_sha256="x"),
        ev(61, "launch_exit", rank=None, code=0, reason="finished", seconds=61),
    ]
    report = build_report(log)
    first, second = report["incidents"]
    assert first["in_process"] and first["steps_lost"] == 0 and first["resumed_from_step"] == 25
    assert first["time_to_recover"] == pytest.approx(0.8)
    assert not second["in_process"] and second["resumed_from_step"] == 40 and second["time_to_recover"] == 5.0
    assert report["failure_recovery"]["in_process"] == {"count": 1, "median_seconds": 0.8, "steps_lost": 0}
    assert report["failure_recovery"]["group_restart"]["count"] == 1
    assert "failures recovered: in process 1 (median 0.800 s to recover, 0 steps lost)" in render_text(report)


def test_a_node_that_joins_is_part_of_the_launch_and_its_stop_is_a_membership_change():
    """Two nodes' launchers (pids 1 and 2) write one launch; node 1 joins later, node 0's launcher
    asks for a checkpointed stop (membership_change), and both nodes start the next group: one
    launch, two group starts, and the stop is a membership change, not a preemption."""
    log = [
        ev(0, "launch", rank=None, nnodes="1:2"),
        ev(1, "workers_started", rank=None, restart=0, node=0, nodes=1, world_size=2),
        ev(10, "start", 0, first_step=0, world_size=2),
        ev(20, "checkpoint_committed", 10, bytes=100, seconds=0.1, reason="interval"),
        dict(ev(21, "launch", rank=None, nnodes="1:2"), pid=2),
        ev(22, "membership_change", rank=None, nodes_waiting=1),
        ev(22.1, "stop_requested", 12, reason="signal", signal="SIGTERM"),
        ev(22.2, "checkpoint_committed", 12, bytes=100, seconds=0.1, reason="signal"),
        ev(22.3, "exit", 12, code=75, reason="signal"),
        ev(22.5, "membership_restart", rank=None, nodes_waiting=1),
        dict(ev(23, "workers_started", rank=None, restart=0, node=1, nodes=2, world_size=3), pid=2),
        ev(23, "workers_started", rank=None, restart=0, node=0, nodes=2, world_size=3),
        ev(28, "start", 12, first_step=12, world_size=3, resumed_from="step-12"),
        ev(40, "end", 30, state_sha256="x"),
        dict(ev(41, "launch_exit", rank=None, code=0, reason="finished", seconds=20), pid=2),
        ev(41, "launch_exit", rank=None, code=0, reason="finished", seconds=41),
    ]
    report = build_report(log)
    assert report["launches"] == 1 and report["attempts"] == 2 and report["status"].startswith("finished")
    (inc,) = report["incidents"]
    assert inc["kind"] == "membership_change" and inc["steps_lost"] == 0 and inc["resumed_from_step"] == 12
    sizes = [(w["world_size"], w["first_step"]) for w in report["world_sizes"]]
    assert sizes == [(2, 0), (3, 12)], sizes


def test_a_node_that_joins_in_place_starts_no_group_and_a_later_stop_is_not_a_membership_change():
    """Node 1's launcher (pid 2) joins the running group in place and is node 0 of the new round:
    its workers_started (joined_generation) is no new group start, the ranks grow 2 → 3 at step
    12, and the SIGTERM that ends the launch later is a preemption, not a membership change."""
    log = [
        ev(0, "launch", rank=None, nnodes="1:2"),
        ev(1, "workers_started", rank=None, restart=0, node=0, nodes=1, world_size=2),
        ev(10, "start", 0, first_step=0, world_size=2),
        dict(ev(21, "launch", rank=None, nnodes="1:2"), pid=2),
        ev(22, "membership_change", rank=None, nodes_waiting=1, in_place=True),
        dict(
            ev(22.5, "workers_started", rank=None, restart=0, node=0, nodes=2, world_size=3, joined_generation=1), pid=2
        ),
        ev(23, "world_size_changed", 12, from_world_size=2, to_world_size=3, in_process=True, joined=[2]),
        ev(30, "stop_requested", 40, reason="signal", signal="SIGTERM"),
        ev(30.2, "checkpoint_committed", 40, bytes=100, seconds=0.1, reason="signal"),
        ev(30.3, "exit", 40, code=75, reason="signal"),
        dict(ev(31, "launch_exit", rank=None, code=75, reason="ranks stopped for requeue", seconds=10), pid=2),
        ev(31, "launch_exit", rank=None, code=75, reason="ranks stopped for requeue", seconds=31),
    ]
    report = build_report(log)
    assert report["launches"] == 1 and report["attempts"] == 1, report
    (inc,) = report["incidents"]
    assert inc["kind"] != "membership_change", inc
    sizes = [(w["world_size"], w["first_step"]) for w in report["world_sizes"]]
    assert sizes == [(2, 0), (3, 12)], sizes


def test_a_relaunch_of_a_multi_node_job_whose_launchers_died_is_a_new_launch():
    """The same --nnodes job launched again 5 min after its launchers went silent (killed, no
    launch_exit): not a node joining the dead launch but a new launch, and the old one was lost."""
    log = [
        ev(0, "launch", rank=None, nnodes="2", host="a"),
        dict(ev(0.5, "launch", rank=None, nnodes="2", host="b"), pid=2),
        ev(1, "workers_started", rank=None, restart=0, node=0, nodes=2, world_size=2),
        ev(10, "start", 0, first_step=0, world_size=2),
        ev(20, "checkpoint_committed", 10, bytes=100, seconds=0.1, reason="interval"),
        dict(ev(320, "launch", rank=None, nnodes="2", host="a"), pid=3),
        dict(ev(320.5, "launch", rank=None, nnodes="2", host="b"), pid=4),
        dict(ev(321, "workers_started", rank=None, restart=0, node=0, nodes=2, world_size=2), pid=3),
        ev(330, "start", 10, first_step=10, world_size=2, resumed_from="step-10"),
        ev(340, "end", 20, state_sha256="x"),
        dict(ev(341, "launch_exit", rank=None, code=0, reason="finished", seconds=21), pid=4),
        dict(ev(341, "launch_exit", rank=None, code=0, reason="finished", seconds=21), pid=3),
    ]
    report = build_report(log)
    assert report["launches"] == 2 and report["attempts"] == 2 and report["status"].startswith("finished")
    assert [i["kind"] for i in report["incidents"]] == ["launch_lost"]


@pytest.mark.soak  # the chaos run: a minute of the README suite's 15
def test_copy_of_a_live_run_reports_running(chaos, tmp_path):
    """A log cut in the middle of the second launch (as while it runs): the launch is open."""
    lines = (chaos / "events.jsonl").read_text().splitlines()
    last_launch = max(i for i, line in enumerate(lines) if '"kind":"launch"' in line)
    run = tmp_path / "live"
    run.mkdir()
    (run / "events.jsonl").write_text("\n".join(lines[: last_launch + 6]) + "\n")
    report = build_report(load_events(run)[0])
    assert report["status"].startswith("running") and report["exit_code"] is None
    assert sum(report["time_breakdown"].values()) == pytest.approx(report["wall_seconds"], rel=0.01)
