"""``[recovery] roll_forward`` (issue 52 item 1, :mod:`trainguard.rejoin.forward`): a lost peer caught
in a DDP backward is met at the end of that backward pass; the survivors' loop is never rewound and
the replacement runs the interrupted step from the boundary. Real launches (``trainguard run``,
gloo), each against the same script's uninterrupted run.

* ``tests/hand_update_worker.py``: a hand-written update with no optimizer given to the Guard and no
  ``should_step``. Done again, the survivor's own update cannot be undone: today the group
  restarts (``test_hand_update``). Rolled forward, it is recovered in-process with the clean state.
* ``tests/roll_forward_worker.py``: batch norm's buffers, several buckets, two backward passes a
  step, and a counter of the loop's own that a step done again counts twice; rank 1 is killed in
  the step's first or second pass. Rolled forward: in-process, the clean state. Done again (the
  feature off): never announced as bitwise (the replicas' check fails the recovery).
* A step whose script all-reduces before its forward: the replacement ran it alone, said.
* Four ranks, the loss in the second pass: the clean state.

* A loss in the broadcast of the buffers before the step's first forward: met there.
* A loop over a ``StatefulDataLoader`` (not declined when rolled forward) whose loss is caught
  before the forward: refused, saved just in time, resumed with the clean state.

In the README suite: the hand update (the rest in the soak step: the README suite's 15 minutes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import events, final_hash, finish, launch, shared_hash

HAND = Path(__file__).parent / "hand_update_worker.py"
WORKER = Path(__file__).parent / "roll_forward_worker.py"
ON = "recovery.roll_forward=true"  # the default since 2026-12-07, said where a test's subject is it
OFF = "recovery.roll_forward=false"
MET = "from the boundary and met the survivors"


def _launch(run: Path, script: Path, *overrides: str, extra=(), script_args=()):
    return launch(
        run, *overrides, script=script, tiny=False, extra=extra, script_args=script_args, default_recovery=True
    )


def _rolled_forward(run: Path) -> dict:
    """The one recovery of ``run`` (each survivor's ``recovery_finished``): rolled forward,
    nothing done again, no restart. Returns the lowest survivor's event's details."""
    log = Path(f"{run}.log").read_text()
    finished = events(run, "recovery_finished")
    assert finished and not events(run, "group_restart"), log[-3000:]
    assert len({e["details"]["generation"] for e in finished}) == 1, finished
    for e in finished:
        assert e["details"]["redo_step"] is None and e["details"]["steps_lost"] == 0, e
    assert MET in log and "no completed step lost" not in log, log[-3000:]
    return min(finished, key=lambda e: e["rank"])["details"]


@pytest.fixture(scope="module")
def clean_hand(tmp_path_factory) -> str:
    return shared_hash(tmp_path_factory, "hand_update", lambda run: _launch(run, HAND))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> str:
    return shared_hash(tmp_path_factory, "roll_forward", lambda run: _launch(run, WORKER))


def test_an_unguarded_hand_update_is_rolled_forward_in_process_with_the_clean_state(tmp_path, clean_hand):
    run = tmp_path / "run"
    # killed at step 12's boundary: the survivor meets the loss in step 13's gradient buckets
    proc = _launch(run, HAND, ON, extra=("--inject", "rank_killed:rank=1,step=12"))
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    details = _rolled_forward(run)
    assert details["first_step"] == 13 and details["verified"] == ["parameters"]
    assert final_hash(run) == clean_hand


@pytest.mark.soak
def test_a_loss_in_the_first_forwards_buffer_broadcast_is_met_there_with_the_clean_state(tmp_path, clean):
    """Rank 1 killed at step 12's end: the survivor meets the loss in step 13's first forward, in
    the broadcast of batch norm's buffers, before anything of the step was reduced."""
    run = tmp_path / "run"
    proc = _launch(run, WORKER, ON, extra=("--inject", "rank_killed:rank=1,step=12"))
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    _rolled_forward(run)
    assert "in its first forward's broadcast of the buffers" in log() and "cannot be bitwise" not in log()
    assert final_hash(run) == clean


@pytest.mark.soak
@pytest.mark.parametrize("kill_pass", [1, 2])
def test_a_loss_in_either_backward_pass_is_rolled_forward_with_buffers_buckets_and_the_loops_counter(
    tmp_path, clean, kill_pass
):
    run = tmp_path / "run"
    proc = _launch(run, WORKER, ON, script_args=("--kill-in-pass", str(kill_pass)))
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    _rolled_forward(run)
    assert (f"backward pass {kill_pass}" in log()) == (kill_pass > 1)
    assert "cannot be bitwise" not in log()
    assert final_hash(run) == clean


@pytest.mark.soak
def test_done_again_the_loops_counter_moves_twice_and_the_recovery_is_not_announced(tmp_path, clean):
    """The feature off: the survivor's loop counts the interrupted step twice (the Guard cannot
    know the counter), its learning rate differs from its replacement's, and the replicas' check
    after the recovery fails it into a group restart: never announced as a recovery."""
    run = tmp_path / "run"
    proc = _launch(run, WORKER, OFF, script_args=("--kill-in-pass", "1"))
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    assert MET not in log()
    assert not events(run, "recovery_finished") and events(run, "group_restart"), log()[-3000:]


@pytest.mark.soak
def test_a_collective_the_replacement_ran_alone_before_the_meeting_is_said(tmp_path):
    run = tmp_path / "run"
    proc = _launch(run, WORKER, ON, script_args=("--kill-in-pass", "1", "--allreduce-before"))
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    _rolled_forward(run)
    said = [e for e in events(run, "resume_not_bitwise") if "dist.all_reduce alone" in e["details"]["cause"]]
    assert said and "a resume cannot be bitwise identical" in log(), json.dumps(events(run, "resume_not_bitwise"))


@pytest.mark.soak
def test_four_ranks_rolled_forward_from_the_second_pass_end_with_the_clean_state(tmp_path):
    """Three survivors re-send their kept buckets in the same ring (4 ranks: each element summed in
    the ring's order, which the buckets' lengths decide) and meet one replacement."""
    clean_run, run = tmp_path / "clean", tmp_path / "run"
    assert finish(launch(clean_run, ON, nproc=4, script=WORKER, tiny=False, default_recovery=True)) == 0
    proc = launch(
        run, ON, nproc=4, script=WORKER, tiny=False, script_args=("--kill-in-pass", "2"), default_recovery=True
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    _rolled_forward(run)
    assert final_hash(run) == final_hash(clean_run)


@pytest.mark.soak
def test_a_loss_a_stateful_loader_cannot_redo_restarts_from_the_just_in_time_save_with_the_clean_state(tmp_path):
    """Rolled forward, a loop over a ``StatefulDataLoader`` is not declined at start; a loss caught
    outside a backward pass would be done again, which its loader cannot (rank 1 killed at step
    12's end: the survivor meets the loss in step 13's all-reduce before the forward): the
    survivor refuses, says so, saves the last completed step on its way out, and the group
    restarts from it."""
    clean_run, run = tmp_path / "clean", tmp_path / "run"
    args = ("--loader", "--allreduce-before")
    assert finish(_launch(clean_run, WORKER, ON, script_args=args)) == 0
    kill = ("--inject", "rank_killed:rank=1,step=12")
    proc = _launch(run, WORKER, ON, extra=kill, script_args=args)
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    assert "in-process recovery does not apply to this loss: the data position is a StatefulDataLoader's" in log()
    assert [e for e in events(run, "resume") if e["details"]["tier"] == "jit" and e["step"] == 12], log()[-3000:]
    assert final_hash(run) == final_hash(clean_run)
