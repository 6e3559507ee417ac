"""A step done again after a lost peer gets its batch and its random numbers back
(trainguard.rejoin.replay, trainguard.rejoin.gapdraws): the loop's own DataLoader iterator gives
the interrupted attempt's batches again, and the generators take the state the interrupted
attempt's first forward found, when the loop's draws before it (a new epoch's iterator) are not
made again. End to end on the zoo's ImageNet-example shape, whose loop iterates its own
``DataLoader`` and makes a new iterator at each epoch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard.events import read_events
from trainguard.rejoin.gapdraws import NOT_REPEATED, GapDraws
from trainguard.rejoin.replay import CAP, BatchReplay
from trainguard.state.trainstate import RNGState

ZOO = Path(__file__).resolve().parent / "zoo"
sys.path.insert(0, str(ZOO))
import drive  # noqa: E402


def _loader(n: int = 12) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(float(n))), batch_size=2)


def test_a_step_done_again_gets_the_batches_its_attempt_took_and_the_epoch_ends_in_place():
    replay = BatchReplay()
    assert replay.install()
    try:
        assert not BatchReplay().install()  # one wrapper per process: a second Guard's does nothing
        it = iter(_loader())
        replay.step_ended()
        first = next(it)  # the gap: the ImageNet loop's for fetches here
        replay.step_ended()  # step 1 ends
        second, third = next(it), next(it)  # step 2's attempt takes two micro-batches
        replay.step_ended()  # step 2 ends, interrupted: done again
        assert replay.arm() == 2
        again = [next(it), next(it)]
        assert again[0] is second and again[1] is third and replay.served == 2
        replay.step_ended()
        assert torch.equal(next(it)[0], torch.tensor([6.0, 7.0]))  # the iterator was not advanced by the redo
        replay.step_ended()
        assert replay.arm() == 1  # only what the last step took
        assert torch.equal(next(it)[0], torch.tensor([6.0, 7.0]))
        assert [b[0].tolist() for b in it] == [[8.0, 9.0], [10.0, 11.0]]  # then the epoch's end, in place
        assert first is not None
    finally:
        replay.close()
    cls = type(iter(_loader()))
    assert not getattr(cls.__next__, "trainguard_replay", False)  # close() put torch's back


def test_an_iterator_that_yields_more_than_cap_batches_between_step_ends_is_not_kept():
    """An evaluation loop in the gap: its batches are not held, and nothing of it is given back."""
    replay = BatchReplay()
    replay.install()
    try:
        evaluation, training = iter(_loader(2 * (CAP + 3))), iter(_loader())
        replay.step_ended()
        batch = next(training)
        assert len(list(evaluation)) == CAP + 3
        replay.step_ended()
        assert replay.arm() == 1 and next(training) is batch
    finally:
        replay.close()


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x)


def _gap(said: list) -> tuple[GapDraws, RNGState, _Net]:
    net, rng = _Net(), RNGState()
    return GapDraws(net, rng, said.append), rng, net


def test_a_redo_whose_draws_before_the_forward_are_not_made_again_takes_the_attempts_state():
    torch.manual_seed(0)
    said: list = []
    gap, rng, net = _gap(said)
    x = torch.ones(64)
    boundary = rng.state_dict()
    gap.new_step()
    torch.empty(()).random_()  # the epoch's new DataLoader iterator draws its seed
    attempt = net(x)
    rng.load_state_dict(boundary)  # the recovery: back to the step boundary
    gap.restore()
    assert gap.attempt()["forward"] != gap.attempt()["boundary"]  # it drew before its forward
    gap.new_step()
    assert torch.equal(net(x), attempt)  # no draw in the redo's gap: the attempt's state is taken
    # a loop that draws again before its forward keeps its own draws
    boundary = rng.state_dict()
    gap.new_step()
    torch.rand(3)
    attempt = net(x)
    rng.load_state_dict(boundary)
    gap.restore()
    gap.new_step()
    torch.rand(3)
    assert torch.equal(net(x), attempt) and not said


def test_a_replacement_takes_the_survivors_draws_when_seeded_alike_else_undoes_its_set_up_draw():
    """Generator by generator: torch's seeded otherwise on the survivor (another boundary) is
    judged by the draws; seeded alike, the survivors' state at the attempt's forward is taken."""
    torch.manual_seed(1)
    said: list = []
    gap, rng, net = _gap(said)
    x = torch.ones(64)
    lost = rng.state_dict()  # the lost rank's boundary, as the replacement took it
    expected = net(x)  # the lost rank's attempt: no draw before its forward
    torch.rand(1)
    elsewhere = rng.snapshot()  # a survivor whose torch generator was seeded otherwise
    torch.rand(1)
    drawn = rng.snapshot()  # ... and its attempt's state after a draw before the forward
    rng.load_state_dict(lost)
    gap.joined({"boundary": elsewhere[0], "forward": elsewhere[0], "state": elsewhere[1]})
    gap.new_step()
    torch.empty(()).random_()  # the replacement's set-up makes the epoch's iterator
    assert torch.equal(net(x), expected)  # its set-up's draw undone
    rng.load_state_dict(lost)
    gap.joined({"boundary": elsewhere[0], "forward": drawn[0], "state": drawn[1]})
    gap.new_step()
    net(x)  # the attempt drew, the replacement's set-up did not
    assert said == [NOT_REPEATED + " (torch)"]
    # seeded alike: the survivors' boundary is the lost rank's, their state at the forward is taken
    rng.load_state_dict(lost)
    boundary = rng.snapshot()[0]
    torch.empty(()).random_()
    torch.empty(()).random_()  # the attempt's gap: an evaluation's iterator and the epoch's
    forward = rng.snapshot()
    expected = net(x)
    rng.load_state_dict(lost)
    gap.joined({"boundary": list(boundary), "forward": list(forward[0]), "state": forward[1]})
    gap.new_step()
    torch.empty(()).random_()  # the replacement makes the epoch's iterator only
    assert torch.equal(net(x), expected) and len(said) == 1


def _events(run: Path, kind: str) -> list[dict]:
    return list(read_events(run, kind))


@pytest.mark.soak  # moved out of the README suite to keep it under 15 minutes on 2 cores (issue 51); CI runs it
def test_imagenet_shape_killed_at_an_epochs_first_step_and_mid_epoch_recovers_in_process_bitwise(tmp_path):
    """The zoo's ImageNet-example shape (25 steps an epoch, dropout): rank 1 is SIGKILLed at the
    end of step 25, so the survivor's step 26 (the first of epoch 1, whose new iterator drew from
    torch's generator) is done again; rank 0 at the end of step 37 (mid-epoch: its replacement's
    set-up makes the epoch's iterator, a draw the lost rank did not make). Both in-process, two
    replacements, no restart, and the final weights equal the uninterrupted run's (before: the
    survivor's loop took the next batch, the redo check failed the recovery into a restart). The
    step done again (``recovery.roll_forward=false``): the batch replay is its subject."""
    shape = drive.SHAPES["imagenet_ddp"]
    clean = drive.clean_run(shape, tmp_path / "clean")
    assert clean, Path(f"{tmp_path / 'clean'}.log").read_text(errors="replace")[-3000:]
    run = tmp_path / "kill"
    inject = (
        "--inject",
        "rank_killed:rank=1,step=25,section=step",
        "--inject",
        "rank_killed:rank=0,step=37,section=step",
    )
    proc = drive.launch(shape, run, settings=("recovery.roll_forward=false",), extra=inject)
    try:
        code = proc.wait(timeout=300)
    finally:
        drive.stop(proc)
    log = Path(f"{run}.log").read_text(errors="replace")
    assert code == 0, log[-4000:]
    assert len(_events(run, "rank_replaced")) == 2, log[-4000:]
    assert not _events(run, "group_restart") and not _events(run, "recovery_failed"), log[-4000:]
    assert log.count("batch(es) it took from the loop's data loader") == 2, log[-4000:]
    assert drive.hash_of(Path(f"{run}.hash")) == clean, log[-4000:]
