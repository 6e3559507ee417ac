"""Alignment (src/trainguard/rejoin/align.py) and the progress rule end to end: a replacement's
collectives line up with the survivors' before they run together, and a recovery that cannot lead
to a completed step fails in seconds into a group restart instead of waiting for gloo's timeout.

The rules in one process over a real recovery store (a TCPStore), then real launches of an outside
job's shape (tests/resume_barrier_worker.py: ``first = next(guard.steps(n))`` and a
``dist.barrier()`` before its loop) with a rank killed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import events, final_hash, finish, launch, shared_hash
from trainguard.rejoin import align
from trainguard.rejoin.align import END, Alignment, AlignmentError, script_site
from trainguard.rejoin.auth import Seal
from trainguard.rejoin.protocol import RecoveryStore, serve

WORKER = Path(__file__).resolve().parent / "resume_barrier_worker.py"
SEAL = Seal(b"k" * 32)


@pytest.fixture
def store():
    server = serve()
    yield RecoveryStore(server, 1, SEAL)


def test_the_lowest_survivor_names_its_first_collective_once_and_the_others_nothing(store):
    lowest, other = Alignment(), Alignment()
    lowest.survivor(store, 1, 10, lowest=True)
    other.survivor(store, 1, 10, lowest=False)
    assert lowest.open and not other.open
    assert lowest.at("dist.all_reduce at train.py:9", alone_ok=True) is True
    assert not lowest.open and store.survivors_site(1, 0.1) == "dist.all_reduce at train.py:9"
    assert lowest.at("dist.barrier at train.py:3", alone_ok=True) is True  # closed: no more naming
    assert store.survivors_site(1, 0.1) == "dist.all_reduce at train.py:9"


def test_a_replacement_runs_alone_what_the_survivors_are_not_at_then_meets_them(store):
    store.reached(1, "DDP backward")
    seen = []
    a = Alignment()
    a.replacement(store, 1, 10, rank=1, wait=1.0, on_alone=lambda mine, theirs: seen.append((mine, theirs)))
    assert a.at("dist.barrier at train.py:40", alone_ok=True) is False  # alone
    assert a.at("dist.broadcast at train.py:41", alone_ok=True) is False
    assert a.open and seen == [
        ("dist.barrier at train.py:40", "DDP backward"),
        ("dist.broadcast at train.py:41", "DDP backward"),
    ]
    assert a.at("DDP backward", alone_ok=False) is True  # lined up: runs for real, window closed
    assert not a.open and a.at("dist.barrier at train.py:40", alone_ok=True) is True


def test_a_replacement_at_a_collective_that_cannot_run_alone_fails_and_says_so(store):
    store.reached(1, "dist.all_reduce at train.py:60")
    a = Alignment()
    a.replacement(store, 1, 10, rank=1, wait=1.0, on_alone=lambda mine, theirs: None)
    assert a.at("dist.barrier at train.py:40", alone_ok=True) is False
    with pytest.raises(AlignmentError, match="while the survivors wait at dist.all_reduce at train.py:60"):
        a.at("DDP backward", alone_ok=False)
    said = store.gave_up(1)
    assert said is not None and "rank 1" in said and "dist.barrier at train.py:40 alone" in said
    assert not a.open


def test_no_site_from_the_survivors_within_the_wait_fails(store):
    a = Alignment()
    a.replacement(store, 1, 10, rank=1, wait=0.3, on_alone=lambda mine, theirs: None)
    with pytest.raises(AlignmentError, match="reached no collective within 0.3 s"):
        a.at("dist.barrier at train.py:40", alone_ok=True)


def test_the_window_ends_with_the_first_step_after_the_meeting(store):
    survivor = Alignment()
    survivor.survivor(store, 1, 10, lowest=True)
    survivor.step_end(10)  # the step boundary of the meeting itself: not the step after it
    assert survivor.open
    survivor.step_end(11)  # no collective in the step: the survivors name its end
    assert store.survivors_site(1, 0.1) == END and not survivor.open
    replacement = Alignment()
    replacement.replacement(store, 1, 10, rank=1, wait=1.0, on_alone=lambda mine, theirs: None)
    replacement.step_end(11)  # neither side ran a collective: lined up
    assert not replacement.open


def test_a_replacement_whose_first_step_ends_before_the_survivors_collective_fails(store):
    store.reached(1, "dist.all_reduce at train.py:60")
    a = Alignment()
    a.replacement(store, 1, 10, rank=1, wait=1.0, on_alone=lambda mine, theirs: None)
    with pytest.raises(AlignmentError, match="reached the end of the step"):
        a.step_end(11)


def _call_site_here() -> str:
    return script_site("dist.barrier", sys._getframe(0))


def test_a_site_names_the_op_and_the_innermost_frame_outside_trainguard():
    site = _call_site_here()
    assert site.startswith("dist.barrier at ") and "test_align.py" in site and site.endswith("(_call_site_here)")
    assert site != script_site("dist.barrier", sys._getframe(0))  # another line, another site
    assert _call_site_here() == site  # the same call from elsewhere: the same site (only the innermost frame)
    assert align.wait_bound(0.01) == align.WAIT_FLOOR and align.wait_bound(10.0) == 30.0


# ---- end to end --------------------------------------------------------------------------------


def _run(run_dir: Path, *overrides: str, inject: tuple[str, ...] = (), args: tuple[str, ...] = ()):
    return launch(
        run_dir,
        "checkpoint.interval=20",
        "checkpoint.async_save=false",
        *overrides,
        script=WORKER,
        tiny=False,
        default_recovery=True,
        extra=inject,
        script_args=args,
    )


@pytest.fixture
def clean(tmp_path_factory) -> str:
    return shared_hash(tmp_path_factory, "resume_barrier", lambda run_dir: _run(run_dir))


@pytest.mark.parametrize(
    ("args", "survivors_at"),
    [((), "dist.all_reduce"), (("--batchnorm",), "DDP's buffer broadcast (forward)")],
    ids=["plain", "batchnorm"],
)
@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_a_barrier_after_resuming_runs_alone_on_the_replacement_and_recovery_is_bitwise(
    tmp_path, tmp_path_factory, args, survivors_at
):
    """The issue's outside job: rank 1 is SIGKILLed at step 50; its warm spare joins, runs the
    script's barrier after ``next(steps)`` alone (``collective_alone``: the survivors wait at the
    step's logging all-reduce, or, with a batch norm layer, at DDP's buffer broadcast in its
    forward), meets them there, and the run finishes in-process with one replacement and the clean
    weights (before: the barrier met the survivor's all-reduce, gloo's 30 s timeout, and a new
    replacement every 30 s without end). The step done again (``recovery.roll_forward=false``): the
    alignment is its subject; rolled forward, the survivors meet in the step's first forward."""
    clean = shared_hash(tmp_path_factory, "resume_barrier" + "".join(args), lambda d: _run(d, args=args))
    run = tmp_path / "run"
    kill = ("--inject", "rank_killed:rank=1,step=50,section=step")
    proc = _run(run, "recovery.roll_forward=false", inject=kill, args=args)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(events(run, "rank_replaced")) == 1
    assert not events(run, "group_restart") and not events(run, "recovery_failed")
    alone = events(run, "collective_alone")
    assert [e["rank"] for e in alone] == [1] and "dist.barrier" in alone[0]["details"]["site"]
    assert survivors_at in alone[0]["details"]["survivors_at"]
    settled = events(run, "recovery_settled")  # the launcher sees it at a poll: the run may end before
    assert len(settled) <= 1 and not events(run, "recovery_failed")
    done = events(run, "recovery_finished")
    assert len(done) == 1 and done[0]["details"]["first_step"] == done[0]["step"] + 1
    assert "recovered in-process: step" in Path(f"{run}.log").read_text()
    assert final_hash(run) == clean


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_a_replacement_that_cannot_line_up_fails_in_seconds_and_the_group_restarts_once(tmp_path, clean):
    """A replacement that skips a collective the survivors run (``--misalign``) reaches DDP's
    backward while they wait at the script's all-reduce: it says so and exits, the launcher calls
    the recovery failed (``recovery_failed``, quoting the rank) and restarts the group from the
    checkpoint at once: one replacement for the fault, never another, seconds instead of gloo's
    30 s timeout, and the run still ends with the clean weights."""
    run = tmp_path / "run"
    proc = _run(run, inject=("--inject", "rank_killed:rank=1,step=50,section=step"), args=("--misalign",))
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(events(run, "rank_replaced")) == 1
    failed = events(run, "recovery_failed")
    assert len(failed) == 1, Path(f"{run}.log").read_text()[-3000:]
    said = failed[0]["details"]["rank_said"] or ""
    assert "do not line up" in said and "DDP" in said, failed
    assert len(events(run, "group_restart")) == 1
    lost = events(run, "workers_failed")[0]["time"]
    assert failed[0]["time"] - lost < 15, (lost, failed[0]["time"])  # not gloo's 30 s timeout
    # from the last completed step the survivor saved before it was stopped (the just-in-time
    # save), else the checkpoint of step 40: the clean weights either way
    resumed = [e["details"] for e in events(run, "resume")][-1]
    assert resumed["from_step"] == 40 or (resumed["tier"] == "jit" and resumed["from_step"] >= 49), resumed
    assert "in-process recovery failed" in Path(f"{run}.log").read_text()
    assert final_hash(run) == clean


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_a_validation_after_step_end_in_the_abandoned_step_runs_alone_on_the_survivor(tmp_path, tmp_path_factory):
    """The zoo's val_allreduce shape: every 10 steps, after ``guard.step_end``, the loop all-reduces
    a validation loss. Rank 1 is killed at the end of step 49; the survivor loses it in step 50,
    meets the replacement in that step's ``step_end`` and, before doing the step again, runs the
    validation of the abandoned attempt, which the replacement (starting at step 50) never runs.
    It completes on the survivor alone, so the survivors' first collective is the step's own and
    the recovery is in-process and bitwise (before: the survivors named the validation's
    all-reduce, the replacement reached DDP's backward, and the group restarted)."""
    clean = shared_hash(tmp_path_factory, "resume_barrier--val-after-end", lambda d: _run(d, args=("--val-after-end",)))
    run = tmp_path / "run"
    proc = _run(run, inject=("--inject", "rank_killed:rank=1,step=49,section=step"), args=("--val-after-end",))
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert len(events(run, "rank_replaced")) == 1
    assert not events(run, "group_restart") and not events(run, "recovery_failed"), events(run, "recovery_failed")
    assert final_hash(run) == clean
