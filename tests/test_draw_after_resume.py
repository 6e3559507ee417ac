"""A loop of the script's own (``guard.begin()``, ``guard.step_begin()``) that draws random numbers
between the resume and its first step is said not bitwise (found by the zoo's minGPT-DDP shape:
``iter(loader)`` after ``guard.begin()`` draws the workers' base seed from torch's generator, which
the run that saved the checkpoint did not draw at that step; its resume ended with other weights
and said nothing). A loader with a generator of its own draws nothing there, and nothing is said.

Real objects: a world-size-1 gloo group, real Guards and checkpoints, torchdata's StatefulDataLoader."""

from __future__ import annotations

import pytest
import torch
from test_close import config, group  # noqa: F401 (group: the 1-rank gloo fixture)
from torchdata.stateful_dataloader import StatefulDataLoader

import trainguard
from trainguard.events import read_events
from trainguard.state.fidelity import DRAWN_AFTER_RESUME


def _train(run_dir, steps: int, generator: torch.Generator | None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = StatefulDataLoader(torch.randn(64, 4), batch_size=4, generator=generator)  # the position is kept
    cfg = config(run_dir, checkpoint={"interval": 2, "async_save": False})
    with trainguard.Guard(cfg, model=model, optimizer=opt, sampler=loader) as guard:
        guard.begin(steps)
        batches = iter(loader)  # after the resume, before the first step: the workers' seed is drawn here
        while guard.step < steps:
            guard.step_begin()
            loss = model(next(batches)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            guard.step_end(loss)
        guard.finish()


def _causes(run_dir) -> list[str]:
    return [e["details"]["cause"] for e in read_events(run_dir) if e["kind"] == "resume_not_bitwise"]


@pytest.mark.usefixtures("group")
def test_a_draw_between_the_resume_and_the_first_step_is_said(tmp_path, capsys):
    _train(tmp_path, 4, None)
    assert _causes(tmp_path) == []  # a fresh start trains on what its seed drew
    _train(tmp_path, 6, None)  # resumes at step 4
    causes = _causes(tmp_path)
    assert causes[0] == DRAWN_AFTER_RESUME  # at the first step_begin
    # and at the first step's end, the loader's iterator that drew (state.datapos)
    assert len(causes) == 2 and "drew its workers' seed from torch's global generator" in causes[1], causes
    assert (
        "a resume cannot be bitwise identical: random numbers were drawn between the resume" in capsys.readouterr().err
    )


@pytest.mark.usefixtures("group")
def test_a_loader_with_its_own_generator_draws_nothing_there_and_nothing_is_said(tmp_path):
    _train(tmp_path, 4, torch.Generator())
    _train(tmp_path, 6, torch.Generator())
    assert _causes(tmp_path) == []
