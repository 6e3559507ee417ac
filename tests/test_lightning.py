"""PyTorch Lightning under trainguard (trainguard.lightning): real Trainer, DDP on 2 gloo ranks,
real signals and kills (tests/lightning_worker.py)."""

from __future__ import annotations

import json
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


# both runs: a NaN on rank 1 at step 30 is skipped, a loss spike at 45 rolls back in-process to the
# known-good checkpoint of step 30
FAULTS = ("--inject", "nan_loss:rank=1,step=30", "--inject", "loss_spike:rank=0,step=45,factor=1000")
RULES = ("instability.loss_spike=rollback", "instability.known_good_after=5", "instability.min_history=10")


@pytest.mark.soak  # over a minute on 2 cores: scripts/test_soak.sh (CI)
def test_sigterm_after_a_skip_and_a_rollback_and_a_killed_rank_end_bitwise_as_an_uninterrupted_run(
    tmp_path, monkeypatch
):
    clean = tmp_path / "clean"
    assert finish(lightning(clean, *RULES, extra=FAULTS)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    run = tmp_path / "run"
    monkeypatch.setenv("WORKER_HOLD", str(HOLD))  # every rank waits at step HOLD until the signal came
    proc = lightning(run, *RULES, "stop.check_interval=1", extra=FAULTS)
    monkeypatch.delenv("WORKER_HOLD")
    wait_for(lambda: (run / "held").exists(), what=f"the hold at step {HOLD}")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == ExitCode.REQUEUE, Path(f"{run}.log").read_text()[-3000:]
    assert [e["step"] for e in events(run, "step_skipped")] == [30]
    rollback = events(run, "rollback")[0]["details"]
    assert rollback["from_step"] == 45 and rollback["to_step"] == 30
    stop = events(run, "stop_requested")[-1]
    # the rollback put Lightning's counters back with trainguard's: its step 60 is trainguard's 60
    assert stop["details"]["reason"] == "signal" and stop["step"] == HOLD + 1
    assert stop["step"] in [e["step"] for e in events(run, "checkpoint_committed")]

    # the relaunch resumes there, loses rank 1 to SIGKILL 30 steps on, restarts the group, finishes
    kill = f"rank_killed:rank=1,step={stop['step'] + 30}"
    assert finish(lightning(run, *RULES, extra=("--inject", kill))) == 0, Path(f"{run}.log").read_text()[-3000:]
    resumes = [e["details"]["from_step"] for e in events(run, "resume") if e["details"].get("from_step") != 30]
    assert resumes[0] == stop["step"] and len(resumes) == 2 and resumes[1] >= stop["step"]
    assert len(events(run, "group_restart")) == 1
    # the fit loop's position, the data position and the random number streams all came back, after a
    # rollback too; the model trained STEPS steps
    assert final_hash(run) == final_hash(clean)
    assert events(run, "end")[-1]["step"] == STEPS
    report = build_report(events(run))
    assert ("instability_rollback", 45) in [(i["kind"], i["step"]) for i in report["incidents"]]
    assert report["notices"]["step_skipped"] == 1 and report["final_step"] == STEPS


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


@pytest.mark.soak  # two Lightning runs, about a minute on 2 cores: scripts/test_soak.sh (CI)
def test_a_resume_from_a_checkpoint_taken_at_a_validation_step_is_bitwise(tmp_path):
    """The worker validates every 20 steps; checkpoints every 40 fall on validation steps (the
    checkpoint is taken at the step's end, before Lightning's validation of it). Rank 1 is killed at
    step 50: the group restarts from the checkpoint of step 40 and ends bitwise equal to an
    uninterrupted run, which validated at step 40 in between."""
    clean, run = tmp_path / "clean", tmp_path / "run"
    sync = ("checkpoint.interval=40", "checkpoint.async_save=false")  # step 40's is committed before step 41
    assert finish(lightning(clean, *sync, steps=80)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    kill = ("--inject", "rank_killed:rank=1,step=50")
    assert finish(lightning(run, *sync, extra=kill, steps=80)) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["details"]["from_step"] for e in events(run, "resume")] == [40]
    assert len(events(run, "group_restart")) == 1
    assert final_hash(run) == final_hash(clean)


@pytest.mark.soak  # two Lightning runs, about a minute on 2 cores: scripts/test_soak.sh (CI)
def test_killed_ranks_are_replaced_in_process_the_survivors_kept_and_the_run_bitwise(tmp_path):
    """In-process recovery under Lightning (the default): rank 1 SIGKILLs itself at the end of
    step 40, a validation step (the survivor's validation and the next step's collectives lose
    it); then rank 0 SIGKILLs itself inside step 56's ``should_step``, which runs no collective
    (the detectors' values rode in DDP's gradient bucket: instability.fold), so rank 1 completes
    step 56 and loses rank 0 in step 57. Each time a warm spare takes the lost rank's place, the
    survivor keeps its process and runs the interrupted step's forward and backward again on the
    new group: no group restart, no step lost, and the final state is bitwise that of an
    uninterrupted run."""
    clean, run = tmp_path / "clean", tmp_path / "run"
    steps, kills = (
        80,
        ("--inject", "rank_killed:rank=1,step=40", "--inject", "rank_killed:rank=0,step=55,section=should_step"),
    )

    def start(path: Path, *extra: str):
        args = (str(steps),)
        return launch(path, script=WORKER, tiny=False, extra=extra, script_args=args, default_recovery=True)

    assert finish(start(clean)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    proc = start(run, *kills)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "group_restart") and not events(run, "recovery_fallback")
    first = events(run, "workers_started")[0]["details"]["pids"]
    replaced = events(run, "rank_replaced")
    assert [(e["rank"], e["step"]) for e in replaced] == [(1, 40), (0, 56)]  # rank 0 died after the gradients of 56
    finished = events(run, "recovery_finished")
    # the survivor of the first kill is the original rank 0; of the second, rank 1's replacement
    assert [e["pid"] for e in finished] == [int(first["0"]), replaced[0]["details"]["pid"]]
    assert [e["details"]["redo_step"] for e in finished] == [41, 57]
    assert {e["details"]["steps_lost"] for e in finished} == {0}
    assert final_hash(run) == final_hash(clean)
    assert events(run, "end")[-1]["step"] == steps


@pytest.mark.parametrize(
    "validation, kill_at, resumed_from",
    [({"WORKER_VAL_EVERY": "10"}, 13, 10), ({"WORKER_VAL_EPOCHS": "1"}, 35, 32)],
    ids=["val_check_interval", "check_val_every_n_epoch"],
)
@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_a_restart_from_the_checkpoint_of_a_validation_step_is_bitwise(
    tmp_path, monkeypatch, validation, kill_at, resumed_from
):
    """issue 44: a checkpoint taken at a validation step (at the step's end, before Lightning's
    validation of it) resumed in new processes (the group restart after rank 1's SIGKILL reloads it
    as a relaunch does): the resumed run does not validate that step again, so the draw of the
    validation DataLoader's seed must not be part of the training's random stream. Validation
    every 10 steps or at each epoch's end (32 batches a rank), a checkpoint every 5 or 8 steps."""
    for key, value in validation.items():
        monkeypatch.setenv(key, value)
    clean, run = tmp_path / "clean", tmp_path / "run"
    interval = 5 if "WORKER_VAL_EVERY" in validation else 8
    sync = (f"checkpoint.interval={interval}", "checkpoint.async_save=false")  # committed before the next step
    steps = 40
    assert finish(lightning(clean, *sync, steps=steps)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    kill = ("--inject", f"rank_killed:rank=1,step={kill_at}")
    assert finish(lightning(run, *sync, extra=kill, steps=steps)) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["details"]["from_step"] for e in events(run, "resume")] == [resumed_from]
    assert not events(run, "resume_not_bitwise")
    assert final_hash(run) == final_hash(clean)
    # fit's validation is timed in its own section (trainer.training is False while it runs)
    sections = json.loads((clean / "timeouts.json").read_text())["sections"]
    assert sections.get("validation", {}).get("count", 0) >= 1, sorted(sections)
