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
import sys
import threading
import time
from collections import Counter
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from patch_census import replaced

import trainguard
from trainguard.ranks import Ranks
from trainguard.supervisor.stacks import STACK_SIGNAL

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def census(opt: torch.optim.Optimizer) -> dict:
    """What a Guard could leave behind: threads, signal handlers, optimizer hooks, open files, and
    the process-wide objects it replaced (by identity)."""
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "handlers": [signal.getsignal(s) for s in SIGNALS],
        "optimizer_hooks": (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)),
        "open_files": sorted(_target(fd) for fd in os.listdir("/proc/self/fd")),
        "replaced": replaced(),
        "excepthook": sys.excepthook,
    }


def left_behind(before: dict, after: dict) -> dict:
    """What ``after`` has that ``before`` had not (files: by what they point to; an outcome also
    destroys the default process group, so files may be fewer, never more; process-wide objects:
    those not torch's own, and ``sys.excepthook`` if it is not the one before)."""
    extra = {k: after[k] for k in ("handlers", "optimizer_hooks") if after[k] != before[k]}
    # threads: those running now that were not before (one of the Guard before, still ending when
    # `before` was taken, is not left behind: seen once, under load beside the soak step)
    threads = Counter(after["threads"]) - Counter(before["threads"])
    extra.update({"threads": sorted(threads.elements())} if threads else {})
    extra.update({"replaced": after["replaced"]} if after["replaced"] else {})
    extra.update({"excepthook": after["excepthook"]} if after["excepthook"] is not before["excepthook"] else {})
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
    with trainguard.Guard(config(tmp_path / "warm"), model=model, optimizer=opt) as warm:
        train(warm, model, opt, 1)  # torch's own lazy threads/files
    before = census(opt)

    for attempt in range(2):
        guard = trainguard.Guard(config(tmp_path / f"run{attempt}"), model=model, optimizer=opt)
        during = census(opt)
        assert during["optimizer_hooks"] != before["optimizer_hooks"] and during["handlers"] != before["handlers"]
        # the census sees what a Guard replaces; the collective catch only where it serves (in-process
        # recovery on more than one rank: tests/test_comm_hook.py's census), not on one rank
        assert {"torch.nn.utils.clip_grad_norm_", "sys.excepthook"} <= set(during["replaced"]), during
        assert "torch.distributed.all_reduce" not in during["replaced"]
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


def test_sys_excepthook_is_trainguards_while_a_guard_is_open_and_the_previous_one_after_close(
    tmp_path, group, monkeypatch
):
    """The Guard tells an uncaught lost-peer error in one line (console.quiet_peer_loss, through
    sys.excepthook); its close puts back the hook it found, also after a failure's release (which
    keeps trainguard's for the error on its way out)."""

    def scripts_own(kind, exc, tb):
        sys.__excepthook__(kind, exc, tb)

    monkeypatch.setattr(sys, "excepthook", scripts_own)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = trainguard.Guard(config(tmp_path / "run0"), model=model, optimizer=opt)
    assert sys.excepthook is not scripts_own  # trainguard's, which calls the script's for other errors
    guard.close()
    assert sys.excepthook is scripts_own
    with pytest.raises(RuntimeError, match="boom"):
        with trainguard.Guard(config(tmp_path / "run1"), model=model, optimizer=opt) as guard:
            raise RuntimeError("boom")  # a crash: the Guard releases what needs no peer, the error goes on
    assert sys.excepthook is not scripts_own  # kept for the error on its way out
    guard.close()
    assert sys.excepthook is scripts_own


def _slow_thread_exit(frame, event, arg):
    """A thread trace (threading.settrace) under which a thread pool's worker takes half a second
    to end once told to, as on a loaded machine where it gets no CPU that long (seen at load 4)."""
    if event != "call" or frame.f_code.co_name != "_worker" or "concurrent.futures" not in frame.f_globals["__name__"]:
        return None

    def on_return(frame, event, arg):
        if event == "return":
            time.sleep(0.5)  # not a wait for anything: the thread's own slowness
        return on_return

    return on_return


def test_the_replacement_runners_patches_are_undone_when_its_script_ends(tmp_path):
    """``python -m trainguard.rejoin.replacement`` replaces DDP's constructor, ``init_process_group``
    and (a warm spare) ``os.environ``'s class for the script it runs; they are put back when the
    script ends, as is the collective catch it installs."""
    from trainguard.rejoin import replacement

    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "sys.path.insert(0, os.environ['CENSUS_DIR'])\n"
        "from patch_census import replaced\n"
        "open(os.environ['CENSUS_OUT'], 'w').write(repr(replaced()))\n"
    )
    before = replaced()
    environ_class = type(os.environ)
    os.environ.update(CENSUS_DIR=os.path.dirname(__file__), CENSUS_OUT=str(tmp_path / "during"))
    try:
        replacement.main([str(script)])
    finally:
        for key in ("CENSUS_DIR", "CENSUS_OUT"):
            os.environ.pop(key)
    during = (tmp_path / "during").read_text()
    assert "DistributedDataParallel.__init__" in during and "torch.distributed.init_process_group" in during
    assert "torch.distributed.all_reduce" in during
    assert replaced() == before == [] and type(os.environ) is environ_class


def test_a_checkpointer_closed_without_waiting_still_joins_its_idle_writer_thread(tmp_path, group):
    """close(wait=False), as a failure's release runs it, with no save in flight: the writer's
    thread has ended when close returns, however slow it is to end (the Guard's close after it
    has nothing left to join)."""
    from trainguard.checkpoint.checkpointer import Checkpointer
    from trainguard.events import EventLog
    from trainguard.sections import CheckpointSection

    log = EventLog(tmp_path, 0)
    threading.settrace(_slow_thread_exit)  # for the threads started from now on: the writer's
    try:
        ckpt = Checkpointer(CheckpointSection(async_save=True), tmp_path, log, torch.nn.Linear(2, 2), None, Ranks(0, 1))
    finally:
        threading.settrace(None)
    try:
        writers = [t for t in threading.enumerate() if t.name.startswith("trainguard-ckpt_")]
        assert writers, "the writer's thread starts with the Checkpointer"
        ckpt.close(wait=False)
        assert not [t.name for t in writers if t.is_alive()]
    finally:
        log.close()
