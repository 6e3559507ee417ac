"""A Guard scoped to itself (issue 51): one live Guard per process (a second is refused, one after
the other works), a constructor that leaves nothing installed when any error leaves it, nothing
frozen in the garbage collector after an outcome a notebook catches; and the review's bugs: a
collective's site whatever path started the script, ``async_op=True`` answered with a work
object, usage errors told apart from lost peers, a step's first forward forgotten at the next.

Real objects: a world-size-1 gloo group, real Guards, frames, generators and a module."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch
import torch.distributed as dist
from patch_census import replaced
from test_close import config

import trainguard
from trainguard.outcomes import BadInput, Requeue
from trainguard.rejoin import align
from trainguard.rejoin.catch import LOCAL, Catch, DoneWork
from trainguard.rejoin.gapdraws import GapDraws
from trainguard.rejoin.protocol import is_peer_failure
from trainguard.state.trainstate import RNGState

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():  # an outcome destroys the default group as the process leaves
        dist.destroy_process_group()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def test_a_second_live_guard_is_refused_and_one_after_the_other_works(tmp_path, group):
    model, opt = _model()
    first = trainguard.Guard(config(tmp_path / "a"), model=model, optimizer=opt)
    steps = first.steps(5)
    next(steps)  # the first Guard is training
    with pytest.raises(BadInput, match="another Guard of this process .* is still open"):
        trainguard.Guard(config(tmp_path / "b"), model=model, optimizer=opt)
    assert "torch.nn.utils.clip_grad_norm_" in replaced()  # the first one's wrappers are still its own
    first.close()
    assert replaced() == []
    with trainguard.Guard(config(tmp_path / "b"), model=model, optimizer=opt) as second:
        for _ in second.steps(1):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            second.step_end()
    assert replaced() == []


def test_each_guard_notes_the_scripts_calls_in_its_own_catch(tmp_path, group):
    """No process-wide object holds a Guard's callbacks: each Guard builds its own catch (the
    wrappers close over it), and a Guard built after another is closed is told nothing of what
    the first one's wrappers saw, nor the first of the second's."""
    model, opt = _model()

    def step(guard: trainguard.Guard) -> None:
        model(torch.ones(1, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # through the Guard's wrapper
        assert guard.catch.step_norm() is not None
        opt.step()
        opt.zero_grad()
        guard.step_end()

    with trainguard.Guard(config(tmp_path / "a"), model=model, optimizer=opt) as first:
        for _ in first.steps(1):
            step(first)
    with trainguard.Guard(config(tmp_path / "b"), model=model, optimizer=opt) as second:
        assert second.catch is not first.catch
        for _ in second.steps(1):
            step(second)
    assert first.catch.step_norm() is not None  # still its one norm: the second Guard's clip was not noted in it
    assert replaced() == []


def test_a_guard_that_finished_training_unclosed_is_closed_by_the_next_one(tmp_path, group, capsys):
    model, opt = _model()
    first = trainguard.Guard(config(tmp_path / "a"), model=model, optimizer=opt)
    for _ in first.steps(1):  # the README's loop: no close() after it
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        first.step_end()
    with trainguard.Guard(config(tmp_path / "b"), model=model, optimizer=opt):
        assert "finished training unclosed: closed now" in capsys.readouterr().err
    assert replaced() == []


def test_an_error_that_leaves_the_constructor_leaves_nothing_installed(tmp_path, group):
    handlers = [signal.getsignal(s) for s in SIGNALS]
    model, _ = _model()
    with pytest.raises(Exception) as caught:  # not an optimizer: an error of the script's, not an outcome
        trainguard.Guard(config(tmp_path / "run"), model=model, optimizer="not an optimizer")
    assert not isinstance(caught.value, trainguard.Outcome)
    assert [signal.getsignal(s) for s in SIGNALS] == handlers
    assert replaced() == []
    model, opt = _model()  # and a Guard can be built at once
    trainguard.Guard(config(tmp_path / "again"), model=model, optimizer=opt).close()


def test_an_outcome_a_notebook_catches_leaves_nothing_frozen(tmp_path, group):
    model, opt = _model()
    guard = trainguard.Guard(config(tmp_path / "run"), model=model, optimizer=opt)
    (tmp_path / "run" / "KILL").touch()  # the kill switch: save and stop (Requeue) at the next boundary
    with pytest.raises(Requeue):
        for _ in guard.steps(10):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            guard.step_end()
    assert gc.get_freeze_count() == 0
    assert replaced() == []


def test_a_collectives_site_is_the_same_whether_the_script_was_started_by_a_relative_or_absolute_path(tmp_path):
    script = tmp_path / "train.py"
    source = "import sys\ndef at():\n    return sys._getframe(0)\n"
    script.write_text(source)
    sites = []
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for name in ("train.py", str(script)):  # runpy.run_path("train.py") and python /abs/train.py
            scope: dict = {"__name__": "script"}
            exec(compile(source, name, "exec"), scope)
            sites.append(align.script_site("dist.all_reduce", scope["at"]()))
    finally:
        os.chdir(cwd)
    assert sites[0] == sites[1], sites


def test_an_async_collective_completed_on_this_rank_alone_returns_a_work_object(group):
    catch = Catch()
    catch.install()
    catch.mode = LOCAL  # a replacement before it joined: the script's collectives complete alone
    try:
        t = torch.ones(3)
        work = dist.all_reduce(t, async_op=True)
        assert isinstance(work, DoneWork) and work.wait() is True and work.is_completed()
        assert dist.all_reduce(t, dist.ReduceOp.SUM, None, True).wait()  # async_op by position
        assert dist.all_reduce(t) is None  # a synchronous call returns what torch's returns
    finally:
        catch.uninstall()


@pytest.mark.parametrize(
    "error, lost",
    [
        (dist.DistBackendError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242"), True),
        (dist.DistBackendError("Timed out waiting 2000ms for recv operation to complete"), True),
        (dist.DistNetworkError("failed to recv, got 0 bytes"), True),
        (RuntimeError("Connection reset by peer"), True),
        (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, NCCL version 2.21"), False),
        (dist.DistBackendError("NCCL error: ncclInvalidArgument: invalid argument (root out of range)"), False),
        (RuntimeError("Tensors must be contiguous"), False),
        (ValueError("Connection reset by peer"), False),
    ],
)
def test_lost_peers_are_told_apart_from_usage_errors(error, lost):
    assert is_peer_failure(error) is lost


def test_the_next_step_forgets_the_first_forward_of_the_step_before():
    model = torch.nn.Linear(2, 2)
    draws = GapDraws(model, RNGState(), lambda cause: None)
    draws.new_step()
    model(torch.ones(1, 2))  # step 1's first forward: noted for a redo of step 1
    draws.new_step()  # step 2 begins and is lost before its first forward
    draws.restore()  # step 2 is done again: it has no interrupted forward to give back
    assert draws.attempt() is None
    draws.close()
