"""A resume restores the optimizer's parameter groups as ``Optimizer.load_state_dict`` would, also
the entries the live optimizer lacks: ``initial_lr``, which a learning-rate scheduler adds when it
is built. A script that builds its scheduler after the resume, from the resumed step (the zoo's
start-step shape), took the restored learning rate as its base without it, and trained on with
other learning rates than the uninterrupted run. One process, a real gloo group and
``torch.distributed.checkpoint``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainguard.checkpoint import io
from trainguard.rejoin.stepstart import LOOK_BEGINS, StepStart, schedulers_not_kept


def test_a_resume_restores_initial_lr_that_the_live_optimizer_lacks(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
        dcp.save(io.model_optim_state(model, opt), checkpoint_id=str(tmp_path / "ck"))
        torch.save({}, tmp_path / "ck" / io.rank_file(0))
        again = torch.nn.Linear(3, 2)
        fresh = torch.optim.SGD(again.parameters(), lr=0.3)  # no scheduler yet: no initial_lr
        io.load_state(tmp_path / "ck", again, fresh)
        assert fresh.param_groups[0]["initial_lr"] == 0.3 and fresh.param_groups[0]["lr"] == 0.15
        resumed = torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 0.5**s, last_epoch=0)  # built from the step
        resumed.step()
        assert fresh.param_groups[0]["lr"] == 0.3 * 0.5**2  # as the uninterrupted run's next step
    finally:
        dist.destroy_process_group()


def test_schedulers_the_guard_was_not_given_are_found_at_a_redo():
    """A step done again in-process steps a scheduler the Guard does not keep twice: the recovery
    finds such schedulers of the optimizer (and says the run is not bitwise)."""
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    kept = torch.optim.lr_scheduler.StepLR(opt, 3)
    assert schedulers_not_kept(opt, [kept]) == []
    stray = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    assert schedulers_not_kept(opt, [kept]) == ["LambdaLR"]
    assert schedulers_not_kept(opt, []) == ["LambdaLR", "StepLR"]
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert schedulers_not_kept(other, []) == [] and stray.optimizer is opt


def test_a_scheduler_built_after_the_resume_is_kept_and_put_back_at_a_redo():
    """The start-step shape: ``next(guard.steps())`` resumes, then the loop builds a ``LambdaLR``
    from the step it resumed at, not given to the Guard. The step start finds it at the next step
    beginning and puts it back with the optimizer's hyperparameters, so a step done again steps it
    once; one built after the first :data:`LOOK_BEGINS` beginnings is still named as not kept."""
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    start = StepStart(opt, None, lambda: False)
    try:
        start.step_begin(1)  # the resume's step
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** (7 + i))
        opt.step()
        sched.step()
        sched.state_dict()  # its __dict__ made: the garbage collector refers to it through that dict
        start.step_begin(1)  # the next step: the scheduler is found and its state kept
        assert start.kept() == [sched] and schedulers_not_kept(opt, start.kept()) == []
        lr, epoch = opt.param_groups[0]["lr"], sched.last_epoch
        opt.step()
        sched.step()  # the interrupted attempt moved it on
        assert sched.last_epoch == epoch + 1 and opt.param_groups[0]["lr"] != lr
        start.restore()
        assert sched.last_epoch == epoch and opt.param_groups[0]["lr"] == lr
        for _ in range(LOOK_BEGINS):
            start.step_begin(1)
        late = torch.optim.lr_scheduler.StepLR(opt, 2)
        start.step_begin(1)
        assert schedulers_not_kept(opt, start.kept()) == ["StepLR"] and late.optimizer is opt
    finally:
        start.close()
