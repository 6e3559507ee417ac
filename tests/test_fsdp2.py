"""FSDP2 (``fully_shard``) end to end on 2 gloo ranks (examples/fsdp2.py): a killed rank restarts the
group from the node-local tier's shards and finishes bitwise; a loss spike rolls back in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, events, final_hash, finish, launch

FSDP2 = REPO / "examples" / "fsdp2.py"
STEPS = 60


def fsdp2(run: Path, *overrides: str, extra: tuple[str, ...] = ()):
    return launch(run, f"train.max_steps={STEPS}", "model.n_layers=2", *overrides, script=FSDP2, extra=extra)


@pytest.mark.soak  # over 40 s on 2 cores: scripts/test_soak.sh (CI)
@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_local_shards_bitwise(tmp_path):
    clean = tmp_path / "clean"
    assert finish(fsdp2(clean, "checkpoint.interval=20")) == 0, Path(f"{clean}.log").read_text()[-3000:]
    run = tmp_path / "run"
    local = (f"checkpoint.local.dir={tmp_path / 'local'}", "checkpoint.local.interval=5", "checkpoint.interval=20")
    proc = fsdp2(run, *local, extra=("--inject", "rank_killed:rank=1,step=37"))
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    resume = events(run, "resume")[-1]["details"]
    # local saves run in the background: step 35's may still be in flight when rank 1 dies at 37
    assert resume["tier"] == "local" and resume["from_step"] in (30, 35), resume
    assert final_hash(run) == final_hash(clean)


@pytest.mark.slow
def test_a_loss_spike_rolls_back_to_the_known_good_shards(tmp_path):
    run = tmp_path / "run"
    spike = ("--inject", "loss_spike:rank=0,step=45,factor=1000")
    rules = ("checkpoint.interval=10", "instability.loss_spike=rollback", "instability.known_good_after=5")
    rules += ("instability.min_history=20",)
    assert finish(fsdp2(run, *rules, extra=spike)) == 0, Path(f"{run}.log").read_text()[-3000:]
    rollback = events(run, "rollback")[0]["details"]
    assert rollback["from_step"] == 45 and rollback["to_step"] in (30, 40), rollback
    assert events(run, "end")[-1]["step"] == STEPS and not events(run, "group_restart")  # in-process
