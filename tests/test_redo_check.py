"""A step done again must see the interrupted attempt's batch (src/trainguard/rejoin/redo_check.py):
the inputs of a step's first forward are kept by reference, and compared in the first forward of
a step done again. One process, a real module and its forward pre-hook."""

from __future__ import annotations

import pytest
import torch

from trainguard.rejoin.redo_check import RedoCheck, same_inputs


def _check() -> tuple[torch.nn.Module, RedoCheck, list[str]]:
    model = torch.nn.Linear(3, 1)
    said: list[str] = []

    def mismatch(why: str) -> None:
        said.append(why)
        raise RuntimeError(why)

    return model, RedoCheck(model, mismatch), said


def test_a_step_done_again_on_the_same_batch_passes_and_on_the_next_batch_fails():
    model, check, said = _check()
    batch, after = torch.randn(4, 3), torch.randn(4, 3)
    check.new_step()
    model(batch)  # the interrupted attempt
    model(after)  # a second forward in the step: not the step's first, not kept
    check.restore()  # the step is done again
    check.new_step()
    model(batch.clone())  # the same values: passes
    check.new_step()
    model(after)  # a step that is not done again is never compared
    check.restore()
    check.new_step()
    with pytest.raises(RuntimeError, match="other inputs than the interrupted attempt"):
        model(torch.randn(4, 3))  # the loop's iterator moved on
    assert len(said) == 1
    check.close()
    model(torch.randn(4, 3))  # no hook any more


def test_a_framework_runs_the_step_again_without_a_new_begin_and_keyword_inputs_count():
    model, check, _ = _check()
    check.new_step()
    model(input=torch.ones(2, 3))
    check.restore()  # inside the framework's step: no new step begins before the forward runs again
    model(input=torch.ones(2, 3))
    check.restore()
    with pytest.raises(RuntimeError):
        model(input=torch.zeros(2, 3))


def test_same_inputs_needs_the_same_count_shapes_dtypes_and_values():
    a = [torch.ones(2), torch.arange(3)]
    assert same_inputs(a, [torch.ones(2), torch.arange(3)])
    assert not same_inputs(a, [torch.ones(2)])
    assert not same_inputs(a, [torch.ones(2), torch.arange(3).float()])
    assert not same_inputs(a, [torch.ones(2), torch.arange(1, 4)])
