"""Guard.close() and ``with Guard(...)``: a Guard built, run and closed in one process leaves nothing
behind, so it can be built again (a notebook, a test, and next the in-process recovery of a rank).

Real objects throughout: a world-size-1 gloo group, async saves (writer thread, its own group),
the node-local tier (deleter thread), the heartbeat record with its stack-dump signal (as under
``trainguard run``), signal handlers, optimizer hooks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from collections import Counter
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import trainguard
from trainguard.supervisor.stacks import STACK_SIGNAL

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def census(opt: torch.optim.Optimizer) -> dict:
    """What a Guard could leave behind: threads, signal handlers, optimizer hooks, open files."""
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "handlers": [signal.getsignal(s) for s in SIGNALS],
        "optimizer_hooks": (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)),
        "open_files": sorted(_target(fd) for fd in os.listdir("/proc/self/fd")),
    }


def left_behind(before: dict, after: dict) -> dict:
    """What ``after`` has that ``before`` had not (files: by what they point to; an outcome also
    destroys the default process group, so files may be fewer, never more)."""
    extra = {k: after[k] for k in ("threads", "handlers", "optimizer_hooks") if after[k] != before[k]}
    files = Counter(after["open_files"]) - Counter(before["open_files"])
    return {**extra, **({"open_files": sorted(files.elements())} if files else {})}


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the descriptor of the listing itself, closed by now
        return ""


def config(run_dir, **extra):
    return trainguard.Config.model_validate(
        {
            "run": {"dir": str(run_dir)},
            "checkpoint": {
                "interval": 2,
                "keep_last": 2,
                "async_save": True,
                "local": {"dir": str(run_dir / "local"), "interval": 1},
            },
            "instability": {"known_good_after": 1},  # old checkpoints lose their protection at once
            **extra,
        }
    )


def train(
    guard: trainguard.Guard,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    seen: Optional[set[str]] = None,
) -> None:
    for _ in guard.steps(steps):
        if seen is not None:
            seen.update(t.name for t in threading.enumerate())
        loss = guard.run_step(lambda mb: model(mb).pow(2).mean(), torch.randn(8, 4))
        if guard.should_step(loss):
            opt.step()
        opt.zero_grad()
        guard.step_end(loss=loss)


def test_build_run_close_build_again_leaves_nothing_behind(tmp_path, group, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_HEARTBEAT_DIR", str(tmp_path / "hb"))  # attach the heartbeat as under trainguard run
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(
        trainguard.Guard(config(tmp_path / "warm"), model=model, optimizer=opt), model, opt, 1
    )  # torch's own lazy threads/files
    before = census(opt)

    for attempt in range(2):
        guard = trainguard.Guard(config(tmp_path / f"run{attempt}"), model=model, optimizer=opt)
        during = census(opt)
        assert during["optimizer_hooks"] != before["optimizer_hooks"] and during["handlers"] != before["handlers"]
        seen: set[str] = set()
        train(guard, model, opt, 7, seen)
        assert "trainguard-ckpt" in {n.split("_")[0] for n in seen}, seen  # the async writer ran
        assert guard.state_sha256 is not None and guard.step == 7
        guard.close()
        guard.close()  # twice is harmless
        assert left_behind(before, census(opt)) == {}, attempt
        assert guard.ckpt.group is None
        assert faulthandler.unregister(STACK_SIGNAL) is False  # the stack-dump signal is no longer registered
        committed = [c.step for c in guard.store.committed()]
        assert committed[-1] == 7 and 2 not in committed, committed  # retention deleted (in its own thread)


def test_context_manager_closes_and_outcomes_propagate_with_their_code(tmp_path, group):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = census(opt)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "KILL").touch()  # the kill switch: stop before training
    with pytest.raises(trainguard.Requeue) as stop:
        with trainguard.Guard(config(tmp_path / "run"), model=model, optimizer=opt) as guard:
            train(guard, model, opt, 5)
    assert stop.value.code == 75 and stop.value.reason == "kill_switch" and isinstance(stop.value, SystemExit)
    assert left_behind(before, census(opt)) == {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # an outcome tears the group down
    exits = [e for e in trainguard.read_events(tmp_path / "run") if e["kind"] == "exit"]
    assert [(e["details"]["code"], e["details"]["reason"]) for e in exits] == [(75, "kill_switch")]


def test_bad_input_is_raised_printed_and_releases_what_was_installed(tmp_path, group, capsys):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = census(opt)
    cfg = config(tmp_path / "run", checkpoint={"interval": 10, "save_final": False})
    guard = trainguard.Guard(cfg, model=model, optimizer=opt)
    with pytest.raises(trainguard.BadInput) as bad:
        next(iter(guard.steps(5)))
    assert bad.value.code == 2 and "checkpoint.interval (10) is larger than max_steps (5)" in str(bad.value)
    assert "trainguard: error: checkpoint.interval (10)" in capsys.readouterr().err
    guard.close()
    assert left_behind(before, census(opt)) == {}
