"""A loop that moves its own state after the step's last gradient bucket (an evaluation whose
``DataLoader`` draws its seed from torch's generator after the update) must find that move in the
step boundary a recovery starts from (src/trainguard/guard/keeper.py): the boundary is kept
before the last bucket and kept again at the step's end when the state moved. A real launch of
tests/resume_barrier_worker.py ``--eval-draws`` (dropout, an evaluation every 10 updates) with a
rank killed at the end of an evaluation step."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_align import _run as align_run

from conftest import events, final_hash, finish, shared_hash


def _run(run_dir: Path, *inject: str, die_in_eval: bool = False, seed_per_rank: bool = False):
    """tests/test_align.py's launch of the resume-then-barrier worker, with dropout and an evaluation."""
    flags = (("--die-in-eval",) if die_in_eval else ()) + (("--seed-per-rank",) if seed_per_rank else ())
    return align_run(run_dir, inject=inject, args=("--eval-draws", *flags))


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
@pytest.mark.timeout(300)
def test_an_evaluation_after_the_update_is_in_the_boundary_the_step_done_again_starts_from(tmp_path, tmp_path_factory):
    """Rank 1 is SIGKILLed at the end of step 50, whose evaluation drew from torch's generator
    after the step's last bucket; the survivor does step 51 again from its boundary of step 50,
    and the replacement starts from rank 1's: both must hold the generator after the evaluation's
    draw, or the dropout masks of every later step differ from the uninterrupted run's (before:
    other weights, nothing said)."""
    clean = shared_hash(tmp_path_factory, "eval_draws", lambda d: _run(d))
    run = tmp_path / "run"
    proc = _run(run, "--inject", "rank_killed:rank=1,step=50,section=step")
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(events(run, "rank_replaced")) == 1 and not events(run, "group_restart")
    assert not events(run, "resume_not_bitwise"), events(run, "resume_not_bitwise")
    assert final_hash(run) == clean


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
@pytest.mark.timeout(300)
def test_a_rank_lost_after_the_last_bucket_takes_the_survivors_move_when_seeded_alike(tmp_path, tmp_path_factory):
    """Rank 1 kills itself inside step 50's evaluation: its boundary of step 50 was kept before the
    step's last bucket, before the evaluation's draw, and never kept again. The survivor's own
    state moved after that bucket: it sends the move to the replacement at the meeting, and since
    torch's generator was seeded alike on every rank (the lost rank's was at the survivor's
    state before the move), the replacement takes the survivor's after it: in-process, nothing
    said, the uninterrupted run's weights (the accelerate shape's hang in the zoo campaign;
    before: ``resume_not_bitwise``, other weights)."""
    clean = shared_hash(tmp_path_factory, "eval_draws", lambda d: _run(d))
    run = tmp_path / "run"
    proc = _run(run, die_in_eval=True)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(events(run, "rank_replaced")) == 1 and not events(run, "group_restart")
    assert not events(run, "resume_not_bitwise"), events(run, "resume_not_bitwise")
    assert final_hash(run) == clean


@pytest.mark.timeout(300)
def test_a_rank_lost_after_the_last_bucket_is_said_not_bitwise_when_seeded_per_rank(tmp_path):
    """The same loss with torch's generator seeded per rank (nanoGPT's seed offset): the lost
    rank's draws in that evaluation cannot be made again, so the replacement says its resume is
    not bitwise (``resume_not_bitwise`` naming the step, a console line), and the run finishes
    in-process."""
    run = tmp_path / "run"
    proc = _run(run, die_in_eval=True, seed_per_rank=True)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(events(run, "rank_replaced")) == 1 and not events(run, "group_restart")
    said = events(run, "resume_not_bitwise")
    assert len(said) == 1 and said[0]["rank"] == 1, said
    assert "after step 50's last gradient bucket and before the step's end" in said[0]["details"]["cause"]
    assert "a resume cannot be bitwise identical: rank 1 was lost after step 50" in Path(f"{run}.log").read_text()
