"""A script error outside the Guard's steps ends the launch at once (docs/launcher.md, "A script
error is not restarted"): real launches of tests/script_error_worker.py that raise before their
first step (with in-process recovery, the default) and after their training loop (with the group
restart: the path that restarted it from the final checkpoint)."""

from __future__ import annotations

from pathlib import Path

from conftest import events, finish, launch

WORKER = Path(__file__).resolve().parent / "script_error_worker.py"


def run_worker(run: Path, where: str, recovery: str):
    return launch(
        run, script=WORKER, tiny=False, script_args=(where,), extra=("--set", recovery), default_recovery=True
    )


def assert_script_error(run: Path, when: str, message: str) -> None:
    log = Path(f"{run}.log").read_text(errors="replace")
    assert not events(run, "group_restart") and not events(run, "give_up"), log[-3000:]
    error = events(run, "script_error")
    assert len(error) == 1 and error[0]["details"]["exit_code"] == 1, log[-3000:]
    lines = error[0]["details"]["traceback"]
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == f"ValueError: {message}", lines
    exit_event = events(run, "launch_exit")[-1]["details"]
    assert exit_event["code"] == 1 and f"the script failed {when}" in exit_event["reason"], exit_event
    assert "not restarted (exit 1):\n    Traceback (most recent call last):" in log


def test_an_error_before_the_first_step_after_init_process_group_is_not_restarted(tmp_path):
    """Each rank raises after ``init_process_group`` and the Guard, before its first step; its
    traceback carries torch's ``[rank<N>]:`` prefixes: the launch ends with exit 1 and the
    traceback, no restart (it used to restart and give up with 76: the prefix hid the traceback)."""
    run = tmp_path / "run"
    assert finish(run_worker(run, "--before", "recovery.in_process=true")) == 1
    assert_script_error(run, "before its first step", "a bug before the first step")
    assert not events(run, "checkpoint_committed")


def test_an_error_after_the_training_loop_is_not_restarted(tmp_path):
    """The loop finishes (final checkpoint, ``end``), then rank 0 raises in a final evaluation
    while rank 1 waits for it in an all-reduce: the launch ends with rank 0's exit code and
    traceback, no restart from the final checkpoint (it used to restart twice and give up with 76)."""
    run = tmp_path / "run"
    assert finish(run_worker(run, "--after", "recovery.in_process=false")) == 1
    assert_script_error(run, "after its training loop", "a bug in the final evaluation")
    assert len(events(run, "end")) == 1 and events(run, "script_error")[0]["details"]["rank"] == 0
