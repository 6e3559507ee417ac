"""A rank whose DataLoader workers hold its sockets is recovered in-process (issue 52).

The workers are forked after ``init_process_group`` (tests/loader_workers_worker.py, 2 per rank,
as tutorial trainers fork them), so each holds a copy of its rank's group connections. When rank 1
is SIGKILLed its workers keep them open: the survivor's collective saw no closed connection, waited
until the workers' own watchdog ended them (~5 s) or the learned step timeout killed it, and the
recovery took 6 s or failed into a group restart. Now the loss is learned from the launcher: it
sees rank 1's process end, ends what is left of its session (the orphaned workers:
``orphans_ended``) and publishes the replacement, and the survivor's watcher cuts the old group's
connections at once (gloo's abort path, on by default).

What this test does not claim: that the result is bitwise. The loop's ResumableSampler is read by
the DataLoader ahead of the batches the loop takes (its prefetch), so the position kept at a step
boundary is ahead of the data consumed (issue 53, the data position)."""

from __future__ import annotations

from pathlib import Path

from conftest import events, finish, launch

WORKER = Path(__file__).parent / "loader_workers_worker.py"


def test_a_rank_whose_loader_workers_hold_its_sockets_is_replaced_in_process_at_once(tmp_path):
    run = tmp_path / "run"
    proc = launch(
        run, script=WORKER, tiny=False, extra=("--inject", "rank_killed:rank=1,step=20"), default_recovery=True
    )
    log = Path(f"{run}.log").read_text
    assert finish(proc) == 0, log()[-3000:]
    assert not events(run, "group_restart") and not events(run, "recovery_failed"), log()[-3000:]
    lost = events(run, "workers_failed")[0]
    assert [e["rank"] for e in events(run, "rank_replaced")] == [1]
    assert events(run, "orphans_ended")[0]["details"]["ranks"] == [1]
    joined = events(run, "generation_joined")[0]
    # the survivor left its collective when the launcher published the loss, not when the workers
    # died (their watchdog looks every 5 s): the replacement joined within a second or two
    assert joined["time"] - lost["time"] < 3.0, joined["time"] - lost["time"]
    finished = events(run, "recovery_finished")
    assert len(finished) == 1 and finished[0]["details"]["steps_lost"] == 0
