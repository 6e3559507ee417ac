"""A full disk never crashes the launcher or a rank (issue: a standing fault campaign): every write
that the file system refuses is counted and said once, and the run ends by its own rules with a
documented exit code. Real full file systems (a small tmpfs filled to its last byte)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import events, fill, finish, launch, wait_for
from trainguard.checkpoint import manifest as mf
from trainguard.events import EventLog, read_events
from trainguard.exitcodes import ExitCode

PLAIN = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"


def test_events_on_a_full_disk_are_counted_and_reported_once_there_is_room(small_fs, capfd):
    log = EventLog(small_fs, rank=0, attempt=0)
    log.emit("start", 0)
    filler = fill(small_fs)
    written = 0
    while log.lost < 3:  # the file's last allocated page still takes a few; then the disk refuses
        log.emit("progress", written + 1, note="x" * 200)  # no exception either way
        written += log.lost == 0
        assert written < 100, "the full disk took 100 events"
    assert "No space left on device" in log.lost_error
    assert capfd.readouterr().err.count("events could not be written") == 1
    filler.unlink()
    log.emit("done")
    log.close()
    got = list(read_events(small_fs))  # a torn line, if any, is skipped
    assert [e["kind"] for e in got] == ["start"] + ["progress"] * written + ["events_lost", "done"]
    assert got[-2]["details"]["count"] == 3 and got[-2]["details"]["first_lost"] == "progress"


@pytest.mark.soak  # 30 s end to end: CI runs it in the soak step (the README suite stays under 15 min)
def test_a_run_dir_that_fills_up_ends_the_launch_with_76_not_a_crash(tmp_path, small_fs):
    """The run directory's disk fills to the last byte after the first checkpoint: the ranks' saves
    fail until ``[checkpoint] max_failures`` gives up (76); the launcher's own writes (events,
    timeouts.json, its record) fail too, and it says so instead of dying with a traceback (it
    exited 1 before). Once there is room again the newest committed checkpoint is intact."""
    run = small_fs  # its log (run.log) is written beside it, off the small disk
    proc = launch(
        run,
        "worker.max_steps=100000",
        "checkpoint.interval=20",
        "checkpoint.max_failures=2",
        "health.preflight=false",  # it would refuse the small disk up front
        script=PLAIN,
        tiny=False,
    )
    wait_for(lambda: events(run, "checkpoint_committed"), what="the first checkpoint")
    filler = fill(run)
    code = finish(proc, timeout=300)
    out = Path(f"{run}.log").read_text(errors="replace")
    assert code == ExitCode.GIVE_UP, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # the ranks give up on their failed saves, or a rank ends on the script's own print to its log
    # file (on the full disk) and the restarts make no checkpoint progress: 76 either way
    assert "events could not be written" in out
    assert "checkpoint saves in a row failed" in out or "consecutive failures without checkpoint progress" in out
    filler.unlink()
    committed = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert committed and mf.verify(committed[-1]) is None
