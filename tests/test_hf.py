"""The Hugging Face Trainer under trainguard (trainguard.hf): a real Trainer with a tiny GPT-2, DDP
on 2 gloo ranks, real signals and kills (tests/hf_worker.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from transformers import GPT2LMHeadModel, TrainingArguments

from conftest import REPO, events, final_hash, finish, launch, wait_for
from trainguard import Config
from trainguard.exitcodes import ExitCode
from trainguard.hf import _check
from trainguard.outcomes import BadInput
from trainguard.report import build_report

WORKER = REPO / "tests" / "hf_worker.py"
STEPS = 160
HOLD = 60  # the run waits there for the SIGTERM (the workers' WORKER_HOLD)


def hf(run: Path, *overrides: str, extra: tuple[str, ...] = (), steps: int = STEPS):
    args = (str(steps), str(run.parent / f"{run.name}-out"))
    return launch(run, "checkpoint.interval=30", *overrides, script=WORKER, tiny=False, extra=extra, script_args=args)


def test_sigterm_stops_at_an_agreed_step_and_a_killed_rank_restarts_the_group_bitwise(tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    assert finish(hf(clean)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    run = tmp_path / "run"
    monkeypatch.setenv("WORKER_HOLD", str(HOLD))  # every rank waits at step HOLD until the signal came
    proc = hf(run, "stop.check_interval=1")
    monkeypatch.delenv("WORKER_HOLD")
    wait_for(lambda: HOLD in [e["step"] for e in events(run, "checkpoint_committed")], what=f"step {HOLD}")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == ExitCode.REQUEUE, Path(f"{run}.log").read_text()[-3000:]
    stop = events(run, "stop_requested")[-1]
    assert stop["details"]["reason"] == "signal" and stop["step"] == HOLD + 1
    # the checkpoint is the Trainer's own format too: from_pretrained loads it
    saved = Path(events(run, "checkpoint_committed")[-1]["details"]["path"])
    assert saved.name == f"step-{stop['step']:08d}" and (saved / "trainer_state.json").is_file()
    GPT2LMHeadModel.from_pretrained(saved)

    # the relaunch resumes there (resume_from_checkpoint=last_checkpoint()), loses rank 1 to SIGKILL,
    # restarts the group, finishes with the uninterrupted run's state
    kill = f"rank_killed:rank=1,step={stop['step'] + 30}"
    assert finish(hf(run, extra=("--inject", kill))) == 0, Path(f"{run}.log").read_text()[-3000:]
    resumes = [e["details"]["from_step"] for e in events(run, "resume")]
    assert resumes[0] == stop["step"] and len(resumes) == 2 and resumes[1] >= stop["step"]
    assert len(events(run, "group_restart")) == 1
    assert final_hash(run) == final_hash(clean)


def test_a_nan_step_is_skipped_and_the_report_reads_the_run(tmp_path):
    run = tmp_path / "run"
    proc = hf(run, "checkpoint.interval=20", extra=("--inject", "nan_loss:rank=1,step=30"), steps=60)
    assert finish(proc) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert [e["step"] for e in events(run, "step_skipped")] == [30]
    report = build_report(events(run))
    assert report["notices"]["step_skipped"] == 1 and report["final_step"] == 60 and report["status"] == "finished"


@pytest.mark.parametrize(
    "args, setting, message",
    [
        (dict(save_strategy="steps"), None, "save_strategy='steps'"),
        (dict(save_strategy="no", max_steps=-1), None, "max_steps=N"),
        (dict(save_strategy="no"), "recovery.in_process", "in_process"),
    ],
)
def test_what_the_callback_cannot_guard_is_refused_by_name(tmp_path, args, setting, message):
    cfg = Config()
    if setting:
        cfg.recovery.in_process = True
    with pytest.raises(BadInput, match=message):
        _check(TrainingArguments(str(tmp_path), **{"max_steps": 10, "use_cpu": True, **args}), cfg)
