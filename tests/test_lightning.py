"""PyTorch Lightning under trainguard (trainguard.lightning): real Trainer, DDP on 2 gloo ranks,
real signals and kills (tests/lightning_worker.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO, events, final_hash, finish, launch, wait_for
from trainguard import Config
from trainguard.exitcodes import ExitCode
from trainguard.outcomes import BadInput
from trainguard.report import build_report

WORKER = REPO / "tests" / "lightning_worker.py"
STEPS = 160
HOLD = 60  # the run waits there for the SIGTERM (the workers' WORKER_HOLD)


def lightning(run: Path, *overrides: str, extra: tuple[str, ...] = (), steps: int = STEPS):
    args = (str(steps),)
    return launch(run, "checkpoint.interval=30", *overrides, script=WORKER, tiny=False, extra=extra, script_args=args)


def test_sigterm_stops_at_an_agreed_step_and_a_killed_rank_restarts_the_group_bitwise(tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    assert finish(lightning(clean)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    run = tmp_path / "run"
    monkeypatch.setenv("WORKER_HOLD", str(HOLD))  # every rank waits at step HOLD until the signal came
    proc = lightning(run, "stop.check_interval=1")
    monkeypatch.delenv("WORKER_HOLD")
    wait_for(lambda: HOLD in [e["step"] for e in events(run, "checkpoint_committed")], what=f"step {HOLD}")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == ExitCode.REQUEUE, Path(f"{run}.log").read_text()[-3000:]
    stop = events(run, "stop_requested")[-1]
    assert stop["details"]["reason"] == "signal" and stop["step"] == HOLD + 1
    assert stop["step"] in [e["step"] for e in events(run, "checkpoint_committed")]

    # the relaunch resumes there, loses rank 1 to SIGKILL 30 steps on, restarts the group, finishes
    kill = f"rank_killed:rank=1,step={stop['step'] + 30}"
    assert finish(lightning(run, extra=("--inject", kill))) == 0, Path(f"{run}.log").read_text()[-3000:]
    resumes = [e["details"]["from_step"] for e in events(run, "resume")]
    assert resumes[0] == stop["step"] and len(resumes) == 2 and resumes[1] >= stop["step"]
    assert len(events(run, "group_restart")) == 1
    # the fit loop's position, the data position and the random number streams all came back
    assert final_hash(run) == final_hash(clean)


def test_a_nan_step_is_skipped_and_a_loss_spike_rolls_back_and_the_report_reads_it(tmp_path):
    run = tmp_path / "run"
    faults = ("--inject", "nan_loss:rank=1,step=30", "--inject", "loss_spike:rank=0,step=70,factor=1000")
    proc = lightning(
        run,
        "checkpoint.interval=20",
        "instability.loss_spike=rollback",
        "instability.known_good_after=5",
        extra=faults,
        steps=120,
    )
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["step"] for e in events(run, "step_skipped")] == [30]
    rollback = events(run, "rollback")[0]["details"]
    assert rollback["from_step"] == 70 and rollback["to_step"] <= 60
    # the model still trained 120 steps: Lightning's max_steps grew by the steps undone
    assert events(run, "end")[-1]["step"] == 120
    report = build_report(events(run))
    assert [(i["kind"], i["step"]) for i in report["incidents"]] == [("instability_rollback", 70)]
    assert report["notices"]["step_skipped"] == 1 and report["final_step"] == 120


def test_gradient_accumulation_by_lightning_is_refused_before_anything_is_written(tmp_path):
    from lightning_worker import Regression

    from trainguard.lightning import TrainguardCallback, pl

    cfg = Config()
    cfg.run.dir = str(tmp_path / "run")
    x = torch.randn(32, 16)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[TrainguardCallback(cfg)],
    )
    with pytest.raises(BadInput, match="accumulate_grad_batches=2"):
        trainer.fit(Regression(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=4))
    assert not (tmp_path / "run").exists()
