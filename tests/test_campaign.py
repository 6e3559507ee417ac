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
