"""nanoGPT's prefetch (issue 44): the first batch fetched before the Guard exists, each next one right
after the forward (tests/nanogpt_worker.py). A process that restores the generators (a relaunch's
resume, an in-process replacement) trains its first step on a batch drawn from the fresh seed: the
resume cannot be bitwise, and the process says so (``resume_not_bitwise`` and a console line)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from conftest import REPO, events, final_hash, finish, launch, wait_for

WORKER = REPO / "tests" / "nanogpt_worker.py"
STEPS = 30
PREFETCH = "fetched before the loop"


def nanogpt(run: Path, *settings: str, extra: tuple[str, ...] = (), in_process: bool = False):
    settings = ("checkpoint.interval=5", "checkpoint.async_save=false", "stop.check_interval=1", *settings)
    return launch(
        run, *settings, script=WORKER, tiny=False, extra=extra, script_args=(str(STEPS),), default_recovery=in_process
    )


def logged(run: Path) -> int:
    path = Path(f"{run}.log")
    text = path.read_text(errors="replace") if path.exists() else ""
    return max((int(ln.split()[1].split("/")[0]) for ln in text.splitlines() if ln.startswith("step ")), default=0)


def causes(run: Path) -> list[tuple[int, int, str]]:
    return [(e["attempt"], e["rank"], e["details"]["cause"]) for e in events(run, "resume_not_bitwise")]


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_a_relaunch_of_a_prefetching_loop_says_its_resume_is_not_bitwise(tmp_path):
    clean, run = tmp_path / "clean", tmp_path / "run"
    assert finish(nanogpt(clean)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    assert not events(clean, "resume_not_bitwise")  # a fresh run is not affected
    proc = nanogpt(run)
    wait_for(lambda: logged(run) >= 8, what="step 8")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == 75, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "resume_not_bitwise")
    assert finish(nanogpt(run)) == 0, Path(f"{run}.log").read_text()[-3000:]
    found = causes(run)
    assert found and all(PREFETCH in c for _, _, c in found), found
    assert {r for _, r, _ in found} == {0, 1}  # each rank drew its first batch from the fresh seed
    assert Path(f"{run}.log").read_text().count("a resume cannot be bitwise identical") == 1  # rank 0's line
    assert final_hash(run) != final_hash(clean)  # what it says: the first resumed step trained on another batch


def test_an_in_process_recovery_in_a_prefetching_loop_is_said_and_fails_into_a_restart(tmp_path):
    """nanoGPT's order, rank 1 killed in step 12: the survivor's step done again gets the batch it
    prefetched for the next step, not the interrupted one's, so the recovery fails at once
    (rejoin.redo_check: ``recovery_failed``, quoting the rank; before: ``recovered in-process … no
    completed step lost`` and another hash, nothing said) and the group restarts from the
    checkpoint, where every rank says its first batch came from the fresh seed
    (``resume_not_bitwise``, on the console too). The step done again: ``[recovery] roll_forward =
    false`` (rolled forward, the survivors keep their prefetched batch and the replacement says its
    first batch came from the fresh seed: the zoo's nanoGPT, ``benchmarks/zoo_kills.py``)."""
    run = tmp_path / "run"
    kill = ("--inject", "rank_killed:rank=1,step=12")
    proc = nanogpt(run, "recovery.roll_forward=false", extra=kill, in_process=True)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["rank"] for e in events(run, "rank_replaced")] == [1]
    resumed = [(r, c) for a, r, c in causes(run) if a == 1]
    assert sorted(r for r, _ in resumed) == [0, 1] and all(PREFETCH in c for _, c in resumed), causes(run)
    failed = events(run, "recovery_failed")
    assert len(failed) == 1 and "other inputs than the interrupted attempt" in (failed[0]["details"]["rank_said"] or "")
    assert len(events(run, "group_restart")) == 1
    log = Path(f"{run}.log").read_text()
    assert "a resume cannot be bitwise identical" in log and "other inputs than the interrupted attempt" in log
    # the warm spare ran the preamble too: its output before taking a rank is in its own file (the
    # restarted group's spare starts after its first step and may be stopped before its preamble)
    spare_logs = sorted((run / "spares").glob("spare-*.log"))
    assert spare_logs and "preamble:" in spare_logs[0].read_text(), spare_logs
