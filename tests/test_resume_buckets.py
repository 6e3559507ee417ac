"""A resume of four DDP ranks is bitwise (issue 44): the bucket layout DDP's reducer rebuilt after its
first step is saved with each checkpoint and imposed on the resumed reducer (with three or more ranks,
where a gradient sits in a bucket decides the order of the sum). ``examples/plain_loop.py`` on 4 gloo
ranks: a SIGTERM and a relaunch, and a group restart after a SIGKILL, each against the uninterrupted
run's final state hash."""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import REPO, events, final_hash, finish, launch, wait_for

WORKER = REPO / "examples" / "plain_loop.py"
STEPS, RANKS = 40, 4


def plain(run: Path, *settings: str, extra: tuple[str, ...] = ()):
    """The plain loop on 4 ranks, a checkpoint every 10 steps (hidden width 2048: several buckets)."""
    return launch(
        run,
        f"worker.max_steps={STEPS}",
        "worker.hidden=2048",
        "checkpoint.interval=10",
        "checkpoint.async_save=false",
        "stop.check_interval=1",  # a SIGTERM stops the run at the next step
        *settings,
        nproc=RANKS,
        script=WORKER,
        tiny=False,
        extra=extra,
    )


def logged(run: Path) -> int:
    text = Path(f"{run}.log").read_text(errors="replace") if Path(f"{run}.log").exists() else ""
    steps = [int(line.split()[1].split("/")[0]) for line in text.splitlines() if line.startswith("step ")]
    return max(steps, default=0)


def test_four_ranks_resume_bitwise_after_a_sigterm_and_after_a_group_restart(tmp_path):
    clean = tmp_path / "clean"
    assert finish(plain(clean), timeout=300) == 0, Path(f"{clean}.log").read_text()[-3000:]
    reference = final_hash(clean)

    restarted = tmp_path / "restarted"  # rank 2 SIGKILLed at step 25: the group restarts from step 20
    proc = plain(restarted, extra=("--inject", "rank_killed:rank=2,step=25"))
    assert finish(proc, timeout=300) == 0, Path(f"{restarted}.log").read_text()[-3000:]
    assert [e["details"]["from_step"] for e in events(restarted, "resume")] == [20]
    assert not events(restarted, "resume_not_bitwise")
    assert final_hash(restarted) == reference

    relaunched = tmp_path / "relaunched"  # SIGTERM once step 12 is logged: the stop saves, a relaunch resumes
    proc = plain(relaunched)
    wait_for(lambda: logged(relaunched) >= 12, timeout=240, what="step 12")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc, timeout=300) == 75, Path(f"{relaunched}.log").read_text()[-3000:]
    assert finish(plain(relaunched), timeout=300) == 0, Path(f"{relaunched}.log").read_text()[-3000:]
    assert events(relaunched, "resume") and not events(relaunched, "resume_not_bitwise")
    assert final_hash(relaunched) == reference
