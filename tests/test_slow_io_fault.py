"""The ``slow_io`` injected fault (``--inject slow_io:rank=R,step=N,seconds=S``): the rank's main
thread stalls in slow I/O that makes progress; the hang supervisor calls it slow, not hung."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import events, finish, launch
from trainguard import faults
from trainguard.config import ConfigError, FaultSpec
from trainguard.events import EventLog, read_events
from trainguard.supervisor.evidence import main_thread_io


def test_parse_and_validate_slow_io():
    s = faults.parse_inject("slow_io:rank=0,step=30,seconds=6.5")
    assert (s.kind, s.rank, s.step, s.seconds, s.section) == ("slow_io", 0, 30, 6.5, "step")
    assert faults.parse_inject("slow_io:rank=1,step=3").seconds == 5.0
    with pytest.raises(ConfigError, match="seconds"):
        faults.parse_inject("slow_io:rank=0,step=3,seconds=0")
    with pytest.raises(ConfigError, match="needs 'step'"):  # a timer thread is not the main thread
        faults.validate([FaultSpec(kind="slow_io", rank=0, after_seconds=2.0)], 2)


def test_slow_io_stalls_the_calling_thread_for_its_seconds_and_moves_bytes_through_it(tmp_path):
    """Fired at its step on the thread that calls ``at()`` (the Guard: the main thread): it returns
    after ``seconds``, its own I/O counters moved, and the event names the fault and its seconds."""
    log = EventLog(tmp_path, 0)
    injector = faults.FaultInjector([faults.parse_inject("slow_io:rank=0,step=3,seconds=0.6")], 0, 2, 0, log)
    injector.arm(10)
    before, t0 = main_thread_io(os.getpid()), time.monotonic()
    injector.at(2, "step")  # not yet
    assert time.monotonic() - t0 < 0.3
    injector.at(3, "step")
    took, after = time.monotonic() - t0, main_thread_io(os.getpid())
    log.close()
    assert 0.6 <= took < 3.0, took
    if before is not None:
        assert after - before >= 2 * faults.SLOW_IO_CHUNK, (before, after)
    (fired,) = [e["details"] for e in read_events(tmp_path, "fault_injected")]
    assert fired["fault"] == "slow_io" and fired["rank"] == 0 and fired["seconds"] == 0.6, fired


@pytest.mark.soak  # about a minute on 2 cores: scripts/test_soak.sh (CI)
def test_a_rank_in_slow_io_past_its_timeout_is_slow_not_hung(tmp_path):
    """Rank 0 does 6 s of slow I/O at step 25, past the learned step timeout (2 s): its main thread
    hardly computes but moves bytes, so the supervisor reports it slow (``slow_section``) and kills
    nothing; the run finishes without a restart."""
    run = tmp_path / "run"
    proc = launch(
        run, "train.max_steps=40", "checkpoint.interval=10", extra=("--inject", "slow_io:rank=0,step=25,seconds=6")
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    (fired,) = events(run, "fault_injected")
    assert fired["details"]["fault"] == "slow_io" and fired["rank"] == 0
    assert not events(run, "hang_detected") and not events(run, "group_restart"), Path(f"{run}.log").read_text()
    slow = [e["details"] for e in events(run, "slow_section")]
    assert slow and slow[0]["rank"] == 0 and slow[0]["section"] == "step", slow
