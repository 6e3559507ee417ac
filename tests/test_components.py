"""The Guard's parts as components (issue 51, item 5): one protocol (begin, step_begin,
should_step, step_end, close), parts registered in order and called at each point in that order,
closed in the reverse order, every closer run even when one raises; a method of the protocol's
name that does not take one step number refused at registration. And a real Guard: its parts'
points are called at the step's points, with the step numbers the protocol names.

Real objects: a world-size-1 gloo group, a real Guard, a module and an optimizer."""

from __future__ import annotations

import pytest
import torch
from test_close import config, group  # noqa: F401 (group: the 1-rank gloo fixture)

import trainguard
from trainguard.guard.parts import Parts


class _Part:
    """A part that writes down each point it is called at."""

    def __init__(self, name: str, heard: list):
        self.name, self.heard = name, heard

    def begin(self, completed: int) -> None:
        self.heard.append((self.name, "begin", completed))

    def step_begin(self, step: int) -> None:
        self.heard.append((self.name, "step_begin", step))

    def close(self) -> None:
        self.heard.append((self.name, "close"))


class _Failing(_Part):
    def close(self) -> None:
        self.heard.append((self.name, "close"))
        raise RuntimeError("this part's close failed")


def test_parts_are_called_in_registration_order_and_closed_in_reverse_even_when_one_close_raises():
    heard: list = []
    p = Parts()
    p.add(_Part("a", heard))
    p.add(_Failing("b", heard))
    p.add(_Part("c", heard))
    p.call("begin", 7)
    p.call("step_begin", 8)
    p.call("should_step", 8)  # no part defines it: nothing happens
    assert heard == [("a", "begin", 7), ("b", "begin", 7), ("c", "begin", 7)] + [
        ("a", "step_begin", 8),
        ("b", "step_begin", 8),
        ("c", "step_begin", 8),
    ]
    heard.clear()
    with pytest.raises(RuntimeError, match="this part's close failed"):
        p.release(collective=True)
    assert heard == [("c", "close"), ("b", "close"), ("a", "close")]  # a closed after b raised


def test_a_method_of_the_protocols_name_that_takes_no_step_number_is_refused_at_registration():
    class Wrong:
        def step_begin(self) -> None: ...

    with pytest.raises(TypeError, match=r"Wrong\.step_begin must take one step number"):
        Parts().add(Wrong())


def test_an_explicit_closer_replaces_the_parts_own_close():
    heard: list = []
    p = Parts()
    p.add(_Part("a", heard), close=lambda: heard.append("closed by the builder"))
    p.release(collective=False)
    assert heard == ["closed by the builder"]


@pytest.mark.usefixtures("group")
def test_a_guards_parts_hear_the_steps_points_with_the_protocols_step_numbers(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    heard: list = []
    with trainguard.Guard(config(tmp_path), model=model, optimizer=opt) as guard:
        guard.parts.add(_Part("probe", heard))  # registered last: called after the Guard's own parts
        assert heard == []  # training begins with the loop's first step
        for _ in guard.steps(2):
            loss = model(torch.ones(1, 4)).sum()
            loss.backward()
            if guard.should_step(loss):
                opt.step()
            opt.zero_grad()
            guard.step_end(loss)
        # training began after 0 completed steps; the steps are numbered from 1
        assert heard == [("probe", "begin", 0), ("probe", "step_begin", 1), ("probe", "step_begin", 2)]
        # the replica check agreed at the start (its begin), the instability recovery let each step end
        assert guard.sdc.last_good == 0
    assert heard[-1] == ("probe", "close")  # closed by the Guard's close(), first of all its parts
