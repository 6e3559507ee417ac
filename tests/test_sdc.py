"""Silent data corruption (trainguard.sdc): exact replica fingerprints in one process, then real
3-rank launches where a bit of rank 1's parameters flips and the replicas are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import events, final_hash, finish, launch
from trainguard.sdc import fingerprint, flip_bit, odd_ones_out

STEPS = 100
# the two 3-rank corruption tests share one clean run: on the same xdist worker, one module fixture
pytestmark = pytest.mark.xdist_group("sdc")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    torch.manual_seed(0)
    params = [torch.randn(64, 33).to(dtype), torch.randn(7).to(dtype)]
    clean = fingerprint(params)
    assert fingerprint([p.clone() for p in params]) == clean  # equal tensors, equal value
    bits = params[0].element_size() * 8
    for bit in range(bits):
        for index in (0, 1000, params[0].numel() - 1):
            flip_bit(params[0], index, bit)
            assert fingerprint(params) != clean, (bit, index)
            flip_bit(params[0], index, bit)  # and back
    assert fingerprint(params) == clean


def test_the_odd_ranks_out_are_named_by_majority():
    assert odd_ones_out([5, 5, 5]) == []
    assert odd_ones_out([5, 7, 5]) == [1]
    assert odd_ones_out([5, 7, 5, 9]) == [1, 3]
    assert odd_ones_out([5, 7]) == [0, 1]  # two replicas that differ: no majority, both named
    assert odd_ones_out([5, 5, 7, 7]) == [0, 1, 2, 3]


def _launch3(run: Path, *settings: str, inject: str = ""):
    extra = ("--inject", inject) if inject else ()
    return launch(run, f"train.max_steps={STEPS}", "checkpoint.interval=10", *settings, nproc=3, extra=extra)


@pytest.fixture(scope="module")
def clean3(tmp_path_factory) -> str:
    """The final hash of a clean 3-rank run with the check every 20 steps (which finds nothing)."""
    clean = tmp_path_factory.mktemp("sdc") / "clean"
    assert finish(_launch3(clean, "sdc.check_interval=20")) == 0, Path(f"{clean}.log").read_text()[-3000:]
    assert not events(clean, "sdc_mismatch") and not events(clean, "sdc_check_off")
    return final_hash(clean)


def test_a_flipped_bit_in_one_replica_is_found_and_rolled_back_to_a_clean_result(tmp_path, clean3):
    """(A clean 3-rank run finds no mismatch in its 5 checks: ``clean3``.) One bit of rank 1's
    first parameter flipped after step 55: the check at step 60 names rank 1 (its replica alone
    differs; they agreed at step 40), every rank reloads the checkpoint of step 40 in-process, the
    checkpoint of step 50 is set aside, the re-run agrees at step 60 (transient), and the run ends
    bitwise equal to the clean one."""
    run = tmp_path / "run"
    code = finish(_launch3(run, "sdc.check_interval=20", inject="sdc:rank=1,step=55"))
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    (m,) = events(run, "sdc_mismatch")
    assert m["step"] == 60 and m["details"]["ranks"] == [1] and m["details"]["last_good"] == 40, m
    fp = m["details"]["fingerprints"]
    assert fp[0] == fp[2] != fp[1] and m["details"]["action"] == "rerun"
    (verdict,) = events(run, "sdc_rerun")  # the re-run of steps 41-60 agreed: a transient fault
    assert verdict["step"] == 60 and verdict["details"]["verdict"] == "transient" and verdict["details"]["ranks"] == [1]
    (rb,) = events(run, "sdc_rollback")
    assert rb["details"]["from_step"] == 60 and rb["details"]["to_step"] == 40
    aside = sorted(p.name for p in (run / "checkpoints").glob(".rolledback-*"))
    assert [n.split("-")[2] for n in aside] == ["00000050"], aside  # 60's save comes after its check: never made
    assert "silent data corruption: the replicas of ranks [1] differ at step 60" in Path(f"{run}.log").read_text()
    assert not events(run, "group_restart")
    assert final_hash(run) == clean3


def test_one_rank_has_no_replica_to_compare(tmp_path):
    run = tmp_path / "run"
    assert finish(launch(run, "train.max_steps=20", "sdc.check_interval=5", nproc=1)) == 0
    (off,) = events(run, "sdc_check_off")
    assert "one rank" in off["details"]["reason"] and not events(run, "sdc_mismatch")


def test_a_clean_1000_step_run_finds_no_mismatch(tmp_path):
    """100 checks of 2 replicas over 1,000 clean steps: no false alarm."""
    run = tmp_path / "run"
    code = finish(launch(run, "train.max_steps=1000", "checkpoint.interval=500", "sdc.check_interval=10"), 300)
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "sdc_mismatch") and not events(run, "sdc_check_off")


def test_a_persistent_flip_excludes_the_host_and_the_relaunch_ends_clean(tmp_path, clean3):
    """The bit of rank 1 flips again each time step 55 is re-run (a bad GPU): the re-run after the
    first rollback differs at step 60 again, on the same rank: persistent. The ranks roll back to
    step 40 once more, rank 1's host goes to RUN_DIR/exclude_nodes and the launch exits 75; the
    relaunch (on good hardware: no fault) resumes from step 40 and ends bitwise equal to the clean
    run."""
    run = tmp_path / "run"
    code = finish(_launch3(run, "sdc.check_interval=20", inject="sdc:rank=1,step=55,persistent=true"))
    assert code == 75, Path(f"{run}.log").read_text()[-3000:]
    assert [e["details"]["action"] for e in events(run, "sdc_mismatch")] == ["rerun", "exclude"]
    (verdict,) = events(run, "sdc_rerun")
    assert verdict["details"]["verdict"] == "persistent" and verdict["details"]["ranks"] == [1]
    stop = events(run, "stop_requested")[-1]["details"]
    assert stop["reason"] == "sdc" and stop["ranks"] == [1]
    assert (run / "exclude_nodes").read_text().split() == stop["hosts"]
    assert finish(_launch3(run, "sdc.check_interval=20")) == 0
    assert events(run, "resume")[-1]["details"]["from_step"] == 40
    assert final_hash(run) == clean3


def test_a_bad_batch_on_every_rank_is_data_not_a_corruption(tmp_path):
    """NaN loss and gradients in step 30 on both ranks (a bad batch): every replica sees it alike,
    so the replicas never differ; the instability detectors skip the step, no SDC event."""
    run = tmp_path / "run"
    inject = ("--inject", "nan_loss:rank=0,step=30", "--inject", "nan_loss:rank=1,step=30")
    code = finish(launch(run, "train.max_steps=60", "checkpoint.interval=20", "sdc.check_interval=10", extra=inject))
    assert code == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["step"] for e in events(run, "step_skipped")] == [30]
    assert not events(run, "sdc_mismatch") and not events(run, "sdc_rerun")
