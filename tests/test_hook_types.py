"""What a Guard hands its hooks has the types the Hook class declares (trainguard.events.Hook):
a real Guard on a world-size-1 gloo group, the README's loop, a hook that records what it got."""

from __future__ import annotations

import typing

import pytest
import torch
import torch.distributed as dist

import trainguard


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _declared(method: typing.Callable, arg: str) -> tuple[type, ...]:
    """The types the annotation of ``arg`` admits (the members of a Union; None as NoneType)."""
    hint = typing.get_type_hints(method, localns={"torch": torch})[arg]
    return typing.get_args(hint) or (hint,)


@pytest.mark.parametrize("given", ["tensor", "float", "none"])
def test_on_step_end_gets_what_step_end_was_given_and_its_annotation_admits_it(tmp_path, group, given):
    got = []

    class Recorder(trainguard.Hook):
        def on_step_end(self, guard, step, loss):
            got.append((step, loss))

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = trainguard.Config.model_validate(
        {"run": {"dir": str(tmp_path)}, "checkpoint": {"interval": 2, "save_final": False}}
    )
    with trainguard.Guard(cfg, model=model, optimizer=opt, hooks=[Recorder()]) as guard:
        for _ in guard.steps(2):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            if guard.should_step(loss):
                opt.step()
            opt.zero_grad()
            guard.step_end(loss={"tensor": loss, "float": loss.item(), "none": None}[given])
    assert [s for s, _ in got] == [1, 2]
    declared = _declared(trainguard.Hook.on_step_end, "loss")
    assert all(isinstance(loss, declared) for _, loss in got), (declared, [type(v) for _, v in got])
    if given == "tensor":
        assert all(torch.is_tensor(v) and v.dim() == 0 for _, v in got)  # as given: no host copy made for the hook
