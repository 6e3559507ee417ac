"""The standing fault campaign (scripts/fault_campaign.py), short: a few seeded trials of random
faults at random steps, every invariant checked after each. Soak (CI runs it after the suite)."""

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
def test_seed_2158_three_ooms_give_up_as_documented_and_the_campaign_accepts_it():
    """Seed 2158 of the long campaign of 2026-11-27: three out-of-memory faults on rank 1 (steps 34,
    48, 93) split the tiny GPT's batch of 4 to 2, then 1, then give up with 76 as documented. The
    campaign first counted that as a violation; it now accepts the documented end when the newest
    committed checkpoint verifies."""
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fault_campaign.py"), "--trials", "1", "--seed", "2158"],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "seed 2158: oom, oom, oom; exit codes [76]: ok" in r.stdout, r.stdout[-4000:]
