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


@pytest.mark.soak  # over a minute on 2 cores: scripts/test_soak.sh (CI)
def test_sigterm_stops_at_an_agreed_step_a_killed_rank_restarts_the_group_bitwise_and_a_nan_is_skipped(
    tmp_path, monkeypatch
):
    # both runs skip step 30 (a NaN loss on rank 1; faults fire in a launch's first group only)
    nan = ("--inject", "nan_loss:rank=1,step=30")
    clean = tmp_path / "clean"
    assert finish(hf(clean, extra=nan)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    run = tmp_path / "run"
    monkeypatch.setenv("WORKER_HOLD", str(HOLD))  # every rank waits at step HOLD until the signal came
    proc = hf(run, "stop.check_interval=1", extra=nan)
    monkeypatch.delenv("WORKER_HOLD")
    wait_for(lambda: HOLD in [e["step"] for e in events(run, "checkpoint_committed")], what=f"step {HOLD}")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == ExitCode.REQUEUE, Path(f"{run}.log").read_text()[-3000:]
    assert [e["step"] for e in events(run, "step_skipped")] == [30]
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
    report = build_report(events(run))
    assert report["notices"]["step_skipped"] == 1 and report["final_step"] == STEPS and report["status"] == "finished"


@pytest.mark.soak  # 37 s: the README suite stays under 15 min on 2 cores; CI runs it in the soak step
def test_a_loss_spike_rolls_back_and_a_relaunch_resumes_the_trainer_steps_ahead(tmp_path, monkeypatch):
    """After a rollback the Trainer counts on while trainguard's step went back: the stop and the
    relaunch keep both where they were (the checkpoint records how far the Trainer is ahead)."""
    run = tmp_path / "run"
    spike = ("--inject", "loss_spike:rank=0,step=40,factor=1000")
    settings = ("checkpoint.interval=10", "instability.loss_spike=rollback", "instability.min_history=10")
    monkeypatch.setenv("WORKER_HOLD", "50")  # the Trainer's step 50: trainguard's 40 (10 undone)
    proc = hf(run, *settings, "instability.known_good_after=5", "stop.check_interval=1", extra=spike, steps=60)
    monkeypatch.delenv("WORKER_HOLD")
    wait_for(lambda: (run.parent / f"{run.name}-out" / "held").exists(), what="the hold at the Trainer's step 50")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == ExitCode.REQUEUE, Path(f"{run}.log").read_text()[-3000:]
    rollback = events(run, "rollback")[0]["details"]
    assert rollback["from_step"] == 40 and rollback["to_step"] == 30
    assert events(run, "stop_requested")[-1]["step"] == 41
    assert finish(hf(run, *settings, steps=60)) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert events(run, "resume")[-1]["details"]["from_step"] == 41 and not events(run, "group_restart")
    # the Trainer ran its 60 steps; trainguard kept 50 of them
    assert events(run, "end")[-1]["step"] == 50
    # trainguard's saves (every 10 steps) print no "Writing model shards" bar (disable_tqdm=True): issue 44
    log = Path(f"{run}.log").read_text()
    assert len(events(run, "checkpoint_committed")) >= 5 and "Writing model shards" not in log


@pytest.mark.parametrize(
    "args, setting, message",
    [
        (dict(save_strategy="steps"), None, "save_strategy='steps'"),
        (dict(save_strategy="no", max_steps=-1), None, "max_steps=N"),
        (dict(save_strategy="no"), "checkpoint.local.dir", "persistent tier only"),
    ],
)
def test_what_the_callback_cannot_guard_is_refused_by_name(tmp_path, args, setting, message):
    cfg = Config()
    if setting:
        cfg.checkpoint.local.dir = str(tmp_path / "local")
    with pytest.raises(BadInput, match=message):
        _check(TrainingArguments(str(tmp_path), **{"max_steps": 10, "use_cpu": True, **args}), cfg)


@pytest.mark.soak  # two Trainer runs, about 1.5 minutes on 2 cores: scripts/test_soak.sh (CI)
def test_killed_ranks_are_replaced_in_process_the_survivors_kept_and_the_run_bitwise(tmp_path):
    """In-process recovery under the Trainer (the default): rank 1 SIGKILLs itself at the end of
    step 20, where a checkpoint is due (the survivor's save loses it: the step is complete; the
    survivor meets the replacement inside step 21 and runs it again); then rank 0 SIGKILLs itself
    inside step 28's ``should_step``, which runs no collective (the detectors' values rode in DDP's
    gradient bucket: instability.fold), so rank 1 completes step 28 and loses rank 0 in step 29
    (it runs that step's two micro-batches again on the new group). Each replacement sets
    the Trainer up at the survivors' step from the newest checkpoint's files
    (``last_checkpoint()``); no group restart, no step lost, bitwise equal to an uninterrupted run."""
    clean, run = tmp_path / "clean", tmp_path / "run"
    steps = 48

    def start(path: Path, *extra: str):
        args = (str(steps), str(path.parent / f"{path.name}-out"))
        return launch(
            path,
            "checkpoint.interval=10",
            script=WORKER,
            tiny=False,
            extra=extra,
            script_args=args,
            default_recovery=True,
        )

    assert finish(start(clean)) == 0, Path(f"{clean}.log").read_text()[-3000:]
    kills = ("--inject", "rank_killed:rank=1,step=20", "--inject", "rank_killed:rank=0,step=27,section=should_step")
    assert finish(start(run, *kills)) == 0, Path(f"{run}.log").read_text()[-3000:]
    assert not events(run, "group_restart") and not events(run, "recovery_fallback")
    first = events(run, "workers_started")[0]["details"]["pids"]
    replaced = events(run, "rank_replaced")
    assert [(e["rank"], e["step"]) for e in replaced] == [(1, 20), (0, 28)]  # rank 0 died after the gradients of 28
    finished = events(run, "recovery_finished")
    assert [e["pid"] for e in finished] == [int(first["0"]), replaced[0]["details"]["pid"]]
    assert [e["details"]["redo_step"] for e in finished] == [21, 29]
    assert {e["details"]["steps_lost"] for e in finished} == {0}
    assert final_hash(run) == final_hash(clean)
    assert events(run, "end")[-1]["step"] == steps
    assert not (run / ".hf-join" / "rank-0").exists() and not (run / ".hf-join" / "rank-1").exists()
