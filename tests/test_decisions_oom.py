"""Out-of-memory decisions in one process: split, retry the same batch, grow back, back off, give up.

A real :class:`~trainguard.oom.MicroBatcher` runs real forward and backward passes of a small
float64 MLP. Out-of-memory errors are the CPU allocator's own: injected through a
:class:`~trainguard.faults.FaultInjector` ``oom`` spec (as ``trainguard run --inject`` does), or
raised by a model whose activations cannot be allocated above a number of samples. Gradients of a
split step are compared with those of one unsplit ``backward`` of the same batch.

Not here: DDP models, whose multi-rank gradient all-reduce (:class:`~trainguard.oom.sync.GradSync`)
and out-of-memory agreement between ranks need two ranks (``tests/test_oom.py``); wrapping a model
in DDP also imports ``torch._dynamo``, seconds of start-up for one test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from trainguard.config import FaultSpec
from trainguard.events import EventLog, read_events
from trainguard.faults import FaultInjector
from trainguard.health.straggler import StragglerDetector
from trainguard.oom import MicroBatcher
from trainguard.outcomes import BadInput, GiveUp
from trainguard.ranks import Ranks
from trainguard.sections import OOMSection, StragglerSection

BATCH = 8


class MLP(torch.nn.Module):
    """A float64 MLP. ``fits``: the most samples whose activations can be allocated; above that the
    hidden activation asks the allocator for more memory than any machine has (a real failure)."""

    def __init__(self, fits: Optional[int] = None):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        self.fits = fits
        self.calls: list[int] = []  # samples per forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        if self.fits is not None and x.shape[0] > self.fits:
            torch.empty(x.shape[0] << 50, dtype=torch.uint8)  # a PiB per sample: beyond any address space
        return self.inner(x)


def batch_for(step: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x, (x**2).sum(1, keepdim=True)


def loss_fn(model: torch.nn.Module):
    return lambda mb: F.mse_loss(model(mb[0]), mb[1])


def reference(step: int, n: int = BATCH) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of one unsplit forward and backward of step ``step``'s batch."""
    model = MLP()
    loss = loss_fn(model)(batch_for(step, n))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def same_grads(model: torch.nn.Module, step: int, n: int = BATCH, scale: float = 1.0) -> bool:
    _, want = reference(step, n)
    return all(torch.allclose(p.grad, scale * w, rtol=1e-12, atol=1e-15) for p, w in zip(model.parameters(), want))


class Rig:
    """A MicroBatcher for rank 0 of a world of 1 with its event log, fault injector and straggler timer."""

    def __init__(self, run_dir: Path, model: torch.nn.Module, faults: tuple[FaultSpec, ...] = (), **oom: Any):
        self.run_dir, self.model = run_dir, model
        self.events = EventLog(run_dir, 0)
        self.faults = FaultInjector(list(faults), 0, 1, 0, self.events)
        self.faults.arm(1000)
        world = Ranks(0, 1, ["localhost"])
        straggler = StragglerDetector(StragglerSection(), world, self.events, run_dir)
        self.micro = MicroBatcher(OOMSection(**oom), model, self.events, self.faults, straggler, world)
        self.sizes: dict[int, int] = {}  # micro-batch size after each step

    def step(self, step: int, n: int = BATCH, **kwargs: Any) -> torch.Tensor:
        for p in self.model.parameters():
            p.grad = None
        loss = self.micro.run(step, loss_fn(self.model), batch_for(step, n), **kwargs)
        self.sizes[step] = self.micro.size
        return loss

    def details(self, kind: str) -> list[dict]:
        return [{"step": e["step"], **e["details"]} for e in read_events(self.run_dir, kind)]

    def close(self) -> None:
        self.micro.close()
        self.events.close()


@pytest.fixture
def rig(tmp_path):
    made: list[Rig] = []

    def make(model: Optional[torch.nn.Module] = None, run_dir: Optional[Path] = None, **kwargs: Any) -> Rig:
        if run_dir is not None:
            run_dir.mkdir()
        made.append(Rig(run_dir or tmp_path, model if model is not None else MLP(), **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def oom(step: int, phase: str = "forward", **more: Any) -> FaultSpec:
    return FaultSpec(kind="oom", rank=0, step=step, phase=phase, **more)


# ------------------------------------------------------------------------------------------------
# the step


def test_a_clean_step_runs_the_whole_batch_once(rig):
    r = rig()
    loss = r.step(1)
    assert r.micro.size == BATCH and r.model.calls == [BATCH] and r.micro.clean == 1
    assert torch.allclose(loss, reference(1)[0], rtol=1e-14) and same_grads(r.model, 1)
    assert not r.details("micro_batch_split") and not r.details("oom")


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_injected_oom_halves_and_retries_the_same_batch_with_the_unsplit_gradients(rig, phase):
    r = rig(faults=(oom(3, phase),), grow_after=50)
    for step in (1, 2, 3):
        loss = r.step(step)
    assert r.sizes == {1: 8, 2: 8, 3: 4}
    assert r.model.calls == [8, 8] + ([8] if phase == "backward" else []) + [
        4,
        4,
    ]  # a forward OOM fails before the model runs
    # the failed attempt's partial gradients were dropped: the retried step's are the whole batch's
    assert same_grads(r.model, 3) and torch.allclose(loss, reference(3)[0], rtol=1e-14)
    (injected,) = r.details("fault_injected")
    assert injected["step"] == 3 and injected["phase"] == phase
    (o,) = r.details("oom")
    assert (o["step"], o["phase"], o["micro_batch"], o["injected"]) == (3, phase, 8, True)
    assert "DefaultCPUAllocator" in o["error"] and o["rss_bytes"] > 0
    (split,) = r.details("micro_batch_split")
    assert split == {
        **split,
        "step": 3,
        "from_size": 8,
        "to_size": 4,
        "batch": 8,
        "accumulation": [1, 2],
        "ranks": {"0": phase},
        "grow_after": 50,
        "backoff": False,
    }


def test_a_real_allocator_failure_splits_until_the_activations_fit(rig):
    r = rig(model=MLP(fits=2), grow_after=50)
    loss = r.step(1)
    assert r.micro.size == 2 and r.model.calls[-4:] == [2, 2, 2, 2]
    assert [(s["from_size"], s["to_size"]) for s in r.details("micro_batch_split")] == [(8, 4), (4, 2)]
    ooms = r.details("oom")
    assert [(o["micro_batch"], o["injected"], o["phase"]) for o in ooms] == [
        (8, False, "forward"),
        (4, False, "forward"),
    ]
    assert all("DefaultCPUAllocator" in o["error"] for o in ooms)
    assert same_grads(r.model, 1) and torch.allclose(loss, reference(1)[0], rtol=1e-14)
    r.step(2)  # the next step starts at the size that fit
    assert r.model.calls[-4:] == [2, 2, 2, 2] and len(r.details("oom")) == 2


def test_other_errors_are_not_taken_for_out_of_memory(rig):
    r = rig()

    def broken(mb):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        r.micro.run(1, broken, batch_for(1))
    assert r.micro.size == BATCH and not r.details("oom")


def test_odd_batches_split_by_ceiling_halves_and_size_one_gives_up(rig):
    r = rig(faults=(oom(2, persistent=True),))
    r.step(1, n=7)
    with pytest.raises(GiveUp) as e:
        r.step(2, n=7)
    assert e.value.exit_code == 76 and e.value.reason == "out_of_memory"
    assert "out of memory at micro-batch size 1 in step 2 (rank 0 in forward)" in e.value.message
    assert [(s["from_size"], s["to_size"], s["accumulation"]) for s in r.details("micro_batch_split")] == [
        (7, 4, [1, 2]),
        (4, 2, [2, 4]),
        (2, 1, [4, 7]),
    ]
    assert [o["micro_batch"] for o in r.details("oom")] == [7, 4, 2, 1]
    (gave_up,) = r.details("oom_give_up")
    assert gave_up["step"] == 2 and gave_up["ranks"] == {"0": "forward"} and gave_up["reason"] == e.value.message


# ------------------------------------------------------------------------------------------------
# grow back, back off


def test_grow_after_clean_steps_and_a_failed_grow_doubles_the_wait(rig):
    r = rig(faults=(oom(1), oom(4, "backward"), oom(12)), grow_after=2)
    for step in range(1, 14):
        r.step(step)
        if step == 4:
            assert same_grads(r.model, 4)  # the step whose grow failed: retried at 4, same gradients
    # split at 1; grow after 2 clean steps (1, 2) at 3; the grow fails at 4: split, wait doubled to
    # 4; grow after 4 clean steps (4..7) at 8; it holds 4 steps (8..11), so the split at 12 keeps it
    assert r.sizes == {1: 4, 2: 4, 3: 8, 4: 4, 5: 4, 6: 4, 7: 4, 8: 8, 9: 8, 10: 8, 11: 8, 12: 4, 13: 4}
    splits = [
        (s["step"], s["from_size"], s["to_size"], s["backoff"], s["grow_after"]) for s in r.details("micro_batch_split")
    ]
    assert splits == [(1, 8, 4, False, 2), (4, 8, 4, True, 4), (12, 8, 4, False, 4)]
    grows = [(g["step"], g["from_size"], g["to_size"], g["accumulation"]) for g in r.details("micro_batch_grow")]
    assert grows == [(3, 4, 8, [2, 1]), (8, 4, 8, [2, 1])]


def test_grow_stops_at_the_batch_and_can_be_turned_off(rig, tmp_path):
    r = rig(faults=(oom(1), oom(1)), grow_after=1)  # two failures in step 1: 8 → 4 → 2
    for step in range(1, 6):
        r.step(step)
    # doubled back after each clean step (wait 1), never past the batch
    assert r.sizes == {1: 2, 2: 4, 3: 8, 4: 8, 5: 8}
    assert [(g["step"], g["from_size"], g["to_size"]) for g in r.details("micro_batch_grow")] == [(2, 2, 4), (3, 4, 8)]
    off = rig(run_dir=tmp_path / "off", faults=(oom(1),), grow_after=1, grow=False)
    for step in range(1, 6):
        off.step(step)
    assert set(off.sizes.values()) == {4} and not off.details("micro_batch_grow")


# ------------------------------------------------------------------------------------------------
# configuration and state


def test_a_configured_micro_batch_size_accumulates_from_the_start(rig):
    r = rig(micro_batch_size=3)
    loss = r.step(1)
    assert r.model.calls == [3, 3, 2] and r.micro.size == 3
    assert same_grads(r.model, 1) and torch.allclose(loss, reference(1)[0], rtol=1e-14)


def test_a_custom_backward_receives_each_micro_batchs_weighted_loss(rig):
    r = rig(micro_batch_size=4)
    seen: list[float] = []

    def backward(loss: torch.Tensor) -> None:
        seen.append(loss.item())
        (2.0 * loss).backward()  # like a loss scaler

    total = r.step(1, backward=backward)
    assert same_grads(r.model, 1, scale=2.0)
    assert sum(seen) == pytest.approx(total.item(), rel=1e-14) and len(seen) == 2


@pytest.mark.parametrize(
    "batch, message",
    [
        (
            (torch.zeros(4, 2), torch.zeros(4, 1)),
            "oom.micro_batch_size=5 is larger than the batch (4 samples on rank 0)",
        ),
        (["no", "tensors"], "needs a batch of tensors"),
        ((torch.zeros(4, 2), torch.zeros(3, 1)), "different first dimensions [3, 4]"),
    ],
)
def test_bad_input_is_refused_before_any_forward(rig, batch, message):
    r = rig(micro_batch_size=5)
    with pytest.raises(BadInput) as e:
        r.micro.run(1, loss_fn(r.model), batch)
    assert e.value.exit_code == 2 and message in e.value.message
    assert r.model.calls == []


def test_state_round_trip_makes_a_resumed_batcher_decide_alike(rig, tmp_path):
    r = rig(faults=(oom(1), oom(3)), grow_after=2)
    for step in range(1, 5):
        r.step(step)
    # split at 1, grow at 3 fails at once (wait doubled to 4), two clean steps since
    state = r.micro.state_dict()
    assert state == {"size": 4, "clean": 2, "wait": 4, "grown": False}
    resumed = rig(run_dir=tmp_path / "resumed", grow_after=2)
    resumed.micro.load_state_dict(state)
    resumed.micro.load_state_dict(None)  # a checkpoint from before this state existed: unchanged
    assert resumed.micro.state_dict() == state
    for step in range(5, 12):
        r.step(step)
        resumed.step(step)
    assert resumed.sizes == {s: r.sizes[s] for s in range(5, 12)} and resumed.sizes[7] == 8
    assert [g["step"] for g in resumed.details("micro_batch_grow")] == [7]
