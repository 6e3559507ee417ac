"""A loop that updates its parameters by hand, with no optimizer given to the Guard (issue 52):
the survivor of a lost peer cannot be rewound by the Guard (no optimizer pre-hook keeps its own
gradients out of the parameters), so the recovery is never announced as in-process unless the
loop asked ``should_step()`` before its update. tests/hand_update_worker.py, 2 gloo ranks, rank 1
SIGKILLed in step 13 (``--inject``), the final state against the uninterrupted run's.

Before: ``recovered in-process ... no completed step lost, step 13 done again`` and another final
state (the survivor applied the step's update with its own gradients, then did the step again)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import events, final_hash, finish, launch, shared_hash

WORKER = Path(__file__).parent / "hand_update_worker.py"
KILL = ("--inject", "rank_killed:rank=1,step=12")


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> str:
    return shared_hash(tmp_path_factory, "hand_update", lambda run: launch(run, script=WORKER, tiny=False))


def test_an_unguarded_hand_update_restarts_the_group_says_why_and_ends_with_the_clean_state(tmp_path, clean):
    """The step done again (``[recovery] roll_forward = false``; rolled forward, the survivors'
    update is never applied twice: ``test_roll_forward``'s hand update)."""
    run = tmp_path / "run"
    proc = launch(run, "recovery.roll_forward=false", script=WORKER, tiny=False, extra=KILL, default_recovery=True)
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    assert "the Guard was given no optimizer: a rank lost in a step is recovered in-process only where" in log()
    assert "in-process recovery does not apply to this loss: the Guard was given no optimizer" in log()
    # nor the just-in-time save: an update through .data would pass for the boundary's state
    assert "just-in-time save off: no torch optimizer was given to the Guard" in log()
    assert not [e for e in events(run, "resume") if e["details"]["tier"] == "jit"]
    assert not events(run, "recovery_finished") and events(run, "group_restart")
    assert final_hash(run) == clean


def test_a_hand_update_behind_should_step_is_recovered_in_process_with_the_clean_state(tmp_path, clean):
    run = tmp_path / "run"
    proc = launch(run, script=WORKER, tiny=False, extra=KILL, script_args=("guarded",), default_recovery=True)
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    finished = events(run, "recovery_finished")
    assert len(finished) == 1 and not events(run, "group_restart"), log()[-3000:]
    assert finished[0]["details"]["verified"] == ["parameters"]  # no optimizer: its state is not compared
    assert final_hash(run) == clean
