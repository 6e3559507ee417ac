"""The standing fault campaign (scripts/fault_campaign.py), short: a few seeded trials of random
faults at random steps, every invariant checked after each, and one trial of 4 ranks as 2
loopback nodes. Soak (CI runs it after the suite)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.soak
@pytest.mark.timeout(1500)
def test_a_short_fault_campaign_has_no_invariant_violation():
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "fault_campaign.py"),
            "--trials",
            "6",
            "--seed",
            "1000",
            "--steps",
            "80",
        ],
        capture_output=True,
        text=True,
        timeout=1400,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "fault campaign: 6 trials" in r.stdout and "6/6" in r.stdout


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_three_ooms_give_up_as_documented_and_the_campaign_accepts_it():
    """Seed 2158 of the long campaign of 2026-11-27 (before the slow_io kind and the 2x2 shape
    changed every seed's draw; the same faults are seed 11280's now): three out-of-memory faults on
    rank 1 (steps 20, 66, 91) split the tiny GPT's batch of 4 to 2, then 1, then give up with 76 as
    documented. The campaign first counted that as a violation; it now accepts the documented end
    when the newest committed checkpoint verifies."""
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fault_campaign.py"), "--trials", "1", "--seed", "11280"],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "seed 11280: oom, oom, oom; exit codes [76]: ok" in r.stdout, r.stdout[-4000:]


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_2x2_trial_with_a_slow_io_stall_has_no_invariant_violation():
    """4 ranks as 2 loopback nodes (two launchers, c10d rendezvous): rank 0 stalls 5.9 s in slow
    I/O at step 25 of 40. Its node's supervisor calls it slow, not hung; the other node's ranks,
    waiting for it, are taken for hung by their own supervisor (it sees its own node only,
    documented) and replaced; both launchers end with 0 and the 4-rank clean hash. About 1.5 min
    on 2 loaded cores (the 2x2 clean run included)."""
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "fault_campaign.py"),
            *("--trials", "1", "--seed", "1099", "--shape", "2x2", "--steps", "40"),
        ],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    out = " ".join(r.stdout.split())  # the console wraps long lines
    assert "seed 1099 [2x2]: slow_io; exit codes [[0, 0]]: ok" in out, out[-4000:]
    assert "slow_io 5.9 s at step 25" in out and "no hang, no kill on its node" in out, out[-4000:]
