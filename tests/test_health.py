"""Straggler detection, the collective liveness ping, and the start-up preflight.

End-to-end tests run ``tests/oom_worker.py`` (a DDP regression through ``guard.run_step``, 2 gloo
ranks) under ``trainguard run``; a slow rank is a real sleep inside its compute (the ``slow_rank``
fault), a stopped rank a real SIGSTOP.
"""

from __future__ import annotations

import socket
from pathlib import Path

from conftest import REPO, events, finish, launch
from trainguard.exitcodes import ExitCode
from trainguard.health.preflight import PreflightError, check_devices, check_free_space, check_writable

WORKER = REPO / "tests" / "oom_worker.py"
REPORTS = (
    "straggler.report_interval_steps=10",
    "straggler.min_samples=5",
    "straggler.warmup_steps=5",
    "stop.check_interval=1",
)


def run_worker(run: Path, *overrides: str, inject: tuple[str, ...] = (), steps: int = 40, timeout: float = 180) -> int:
    extra = tuple(x for spec in inject for x in ("--inject", spec))
    return finish(
        launch(
            run,
            f"worker.max_steps={steps}",
            "checkpoint.interval=10",
            "worker.hidden=4096",
            "worker.batch_size=64",
            *overrides,
            script=WORKER,
            extra=extra,
            tiny=False,
        ),
        timeout,
    )


def log(run: Path) -> str:
    return Path(f"{run}.log").read_text(errors="replace")[-3000:]


def details(run: Path, kind: str) -> list[dict]:
    return [{"step": e["step"], "rank": e["rank"], "time": e["time"], **e["details"]} for e in events(run, kind)]


# ------------------------------------------------------------------------------------------------
# units


def test_free_space_and_device_checks_name_the_problem(tmp_path):
    ok = check_free_space(tmp_path, 1024, 4)
    assert ok["needed_bytes"] == 4096 and ok["free_bytes"] > 4096
    try:
        check_free_space(tmp_path, 2**60, 4)
        raise AssertionError("no error")
    except PreflightError as e:
        assert str(tmp_path) in str(e) and "keep_last + 1" in str(e)
    check_writable(tmp_path / "new" / "dir")
    try:
        check_writable(Path("/proc/trainguard-cannot-write"))
        raise AssertionError("no error")
    except PreflightError as e:
        assert "checkpoint dir /proc/trainguard-cannot-write is not writable" in str(e)
    cpu = {"host": "a", "type": "cpu", "cuda_devices": 0}
    check_devices([cpu, dict(cpu, host="b")])
    try:
        check_devices(
            [
                {"host": "a", "type": "cuda", "name": "H100", "cuda_devices": 8},
                {"host": "b", "type": "cpu", "cuda_devices": 0},
            ]
        )
        raise AssertionError("no error")
    except PreflightError as e:
        assert "rank 1 on b" in str(e)


# ------------------------------------------------------------------------------------------------
# end to end


def test_slow_rank_is_flagged_with_its_host(tmp_path):
    run = tmp_path / "slow"
    code = run_worker(
        run, *REPORTS, "straggler.relative_threshold=0.9", inject=("slow_rank:rank=1,step=1,repeat=100000,factor=2.0",)
    )
    assert code == 0, log(run)
    slow = [f for f in details(run, "straggler_detected") if f["rank"] == 1]
    # reports at steps 15, 25, ... (5 warm-up steps): flagged within two reports, 20 steps
    assert slow and slow[0]["step"] <= 25, details(run, "straggler_detected")
    assert slow[0]["host"] == socket.gethostname() and slow[0]["measure"] == "compute"
    # three times the compute → 0.33 on an idle machine; a slowdown well above the noise of two ranks
    # sharing two cores with another test (30 % was not: under pytest-xdist rank 0 was flagged as
    # often; twice the compute was flagged in only 1 of 3 reports once in a clean-clone CI run).
    # No lower bound: when another test's ranks share the cores the slow rank gets less of them
    # than its peer, and a clean-clone CI run measured 0.16
    assert 0.0 < slow[0]["relative"] < 0.9
    reports = details(run, "straggler_report")
    # two ranks on two busy cores make single windows noisy (another test's ranks share them under
    # pytest-xdist, so rank 0 is flagged now and then too); rank 1 is among the stragglers in most
    assert sum(1 in r["stragglers"] for r in reports) > len(reports) / 2

    # a clean run is not flagged: tests/test_decisions_stop.py (scores from given timings; real timings
    # on a shared 2-core machine make one rank really slower whenever another process takes its core)


def test_stop_if_detected_saves_requeues_and_writes_exclude_nodes(tmp_path):
    run = tmp_path / "stop"
    code = run_worker(
        run,
        *REPORTS,
        "straggler.stop_if_detected=true",  # 4× as slow, default threshold 0.7: well clear of the noise
        inject=("slow_rank:rank=1,step=1,repeat=100000,factor=3.0",),  # of another test sharing the cores
    )
    assert code == ExitCode.REQUEUE, log(run)
    (stop,) = details(run, "stop_requested")
    assert stop["reason"] == "straggler" and stop["ranks"] == [1]
    assert details(run, "checkpoint_committed")[-1]["step"] == stop["step"]
    assert (run / "exclude_nodes").read_text().split() == [socket.gethostname()]


def test_stopped_rank_fails_the_ping_within_its_timeout_and_the_group_restarts(tmp_path):
    run = tmp_path / "ping"
    code = run_worker(
        run,
        "supervisor.enabled=false",
        "health.ping_interval=1",
        "health.ping_timeout=3",
        "stop.check_interval=1",
        "checkpoint.async_save=false",  # step 10 committed before the stop at 15 (this model's background save may not be)
        inject=("rank_hung:rank=1,step=15,hang=sigstop",),
        steps=30,
    )
    assert code == 0, log(run)
    (fault,) = details(run, "fault_injected")
    (timeout,) = details(run, "ping_timeout")
    assert timeout["missing_ranks"] == [1] and timeout["missing_hosts"] == [socket.gethostname()]
    assert timeout["time"] - fault["time"] <= 1 + 3 + 2  # interval + timeout + slack
    assert len(events(run, "group_restart")) == 1 and details(run, "resume")[-1]["from_step"] == 10


def test_preflight_refuses_missing_space_with_exit_2_before_anything_is_written(tmp_path):
    # (an unwritable directory takes the same path to exit 2: unit-tested above)
    full = tmp_path / "full"
    assert run_worker(full, "checkpoint.keep_last=1000000000") == ExitCode.BAD_INPUT
    assert "preflight: not enough free space for checkpoints" in log(full)
    assert not (full / "checkpoints").exists() or not any((full / "checkpoints").iterdir())


def test_preflight_event_of_a_normal_run_says_gpu_skipped(tmp_path):
    run = tmp_path / "ok"
    assert run_worker(run, steps=5) == 0, log(run)
    pre = details(run, "preflight")
    assert {p["rank"] for p in pre} == {0, 1}
    assert pre[0]["gpu"]["status"] == "skipped: no GPU" and pre[0]["space"]["count"] == 4
