"""Instability decisions in one process: skip or escalate, ``warn`` on non-finite gradients, hook
overrides, the rollback target, what a rollback sets up (data skip, ramp, ledger) and the
learning-rate ramp; then the Guard carrying a rollback out in this process.

Everything is real: a ``torch.nn.Linear`` with real gradients, ``torch.optim`` optimizers and
schedulers, a :class:`~trainguard.sampler.ResumableSampler`, checkpoints committed to a store in
``tmp_path``, the event log, and a gloo process group of world size 1 for the collectives
(broadcast of the hooks' answer and of the rollback target, gather of the data positions).
Non-finite values come from the computation (a NaN input, an overflowed gradient) or from the
``nan_loss`` fault injector the end-to-end tests use.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainguard
from trainguard.checkpoint.manifest import describe_files, read_manifest
from trainguard.checkpoint.store import Checkpoint, CheckpointStore
from trainguard.events import EventLog, read_events
from trainguard.exitcodes import ExitCode
from trainguard.instability.lr_ramp import LRRamp
from trainguard.instability.recovery import (
    LEDGER,
    Recovery,
    Rollback,
    Settings,
    SkippedStepError,
    Trained,
    append_ledger,
    checkpoint_id,
    read_ledger,
)
from trainguard.outcomes import GiveUp
from trainguard.ranks import Ranks
from trainguard.sampler import ResumableSampler
from trainguard.sections import InstabilitySection, RollbackSection

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def group():
    """A real gloo process group of world size 1 (the decisions' collectives run on it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():  # a Guard that gave up has destroyed it already, as in a real run
        dist.destroy_process_group()


def events(run_dir: Path, kind: str) -> list[dict]:
    return list(read_events(run_dir, kind))


def commit(store: CheckpointStore, step: int, known_good: bool = False) -> Checkpoint:
    """A committed checkpoint with one data file (marked known-good if asked)."""
    tmp = store.begin(step)
    (tmp / "data").write_bytes(bytes([step % 256]) * (64 + step))
    ckpt = store.commit(tmp, step, describe_files(tmp, ["data"]), {"created": 1_000_000 + step})
    if known_good:
        store.mark_known_good(ckpt, healthy_steps=5)
    return ckpt


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class Rig:
    """A :class:`Recovery` for rank 0 of a world of 1, with a real model, optimizer, sampler,
    checkpoint store and event log under ``run_dir``; ``hooks`` answer ``on_instability``."""

    def __init__(
        self,
        run_dir: Path,
        inst: Optional[dict] = None,
        rb: Optional[dict] = None,
        hooks: tuple[Callable[[dict], Optional[str]], ...] = (),
        verify: str = "full",
        loss_scaler: bool = False,
    ):
        torch.manual_seed(0)
        self.run_dir = run_dir
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.sampler = ResumableSampler(1000, seed=0)
        self.store = CheckpointStore(run_dir / "checkpoints", keep_last=10)
        self.events = EventLog(run_dir, 0)
        self.hooks, self.heard = hooks, []
        self.step = 1
        settings = Settings(
            InstabilitySection(**(inst or {})), RollbackSection(**(rb or {})), run_dir, verify, loss_scaler
        )
        self.rec = Recovery(
            settings,
            Trained(self.model, self.opt, self.sampler),
            self.store,
            self.events,
            Ranks(0, 1),
            lambda: self.step,
            self._ask,
        )

    def _ask(self, event: dict) -> list[Optional[str]]:
        self.heard.append(event)
        return [h(event) for h in self.hooks]

    def check(self, step: int, bad: Optional[str] = None, loss_scale: float = 1.0, grad_norm: Any = None) -> Any:
        """Forward and backward of step number ``step`` on a fixed batch, then ``Recovery.check``.

        ``bad``: ``"nan"`` puts a NaN in the input (loss and gradients NaN); ``"grad_inf"``
        overflows one gradient after backward (the loss stays finite).
        """
        self.step = step
        x = torch.linspace(-1, 1, 32).reshape(8, 4).clone()
        if bad == "nan":
            x[0, 0] = NAN
        loss = (self.model(x) ** 2).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if bad == "grad_inf":
            self.model.weight.grad[0, 0] = INF
        return self.rec.check(step, loss * loss_scale, grad_norm)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def close(self) -> None:
        self.rec.close()
        self.events.close()


@pytest.fixture
def rig(tmp_path):
    """Makes rigs (in ``tmp_path`` unless ``run_dir`` is given) and closes them after the test."""
    made: list[Rig] = []

    def make(run_dir: Optional[Path] = None, **kwargs: Any) -> Rig:
        if run_dir is not None:
            run_dir.mkdir(exist_ok=True)
        made.append(Rig(run_dir or tmp_path, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


# ------------------------------------------------------------------------------------------------
# skip, warn, escalate, give up


def test_healthy_step_is_applied_and_a_nonfinite_one_is_skipped_zeroed_and_refused(rig):
    r = rig()
    assert r.check(1) is True
    r.opt.step()  # allowed
    assert len(r.rec.detector.loss_stats) == 1
    before = r.params()
    assert r.check(2, bad="nan") is False
    assert all(p.grad is None for p in r.model.parameters())  # the step's gradients are dropped
    with pytest.raises(SkippedStepError, match="step 2"):
        r.opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, r.params()))
    assert len(r.rec.detector.loss_stats) == 1  # a skipped step stays out of the statistics
    (ev,) = events(r.run_dir, "instability")
    assert ev["step"] == 2 and ev["details"]["action"] == "skip" and ev["details"]["hook_override"] is False
    assert set(ev["details"]["detectors"]) == {"nonfinite_loss", "nonfinite_grad"}
    (skipped,) = events(r.run_dir, "step_skipped")
    assert skipped["step"] == 2 and skipped["details"] == {"skipped_total": 1, "consecutive": 1}
    assert r.check(3) is True and r.rec.consecutive == 0
    r.opt.step()  # the next healthy step is applied again
    assert not torch.equal(before[0], r.params()[0])


def test_a_grad_scalers_overflow_is_not_an_instability_but_a_nan_loss_still_is(rig):
    """With an enabled GradScaler (fp16), inf gradients under a finite loss are the scaler's routine
    overflow: applied as far as the Guard is concerned (``scaler.step`` skips it), no event, no skip
    counted. A non-finite loss is still an instability."""
    r = rig(loss_scaler=True)
    assert r.check(1, bad="grad_inf") is True
    r.opt.step()  # not refused by the Guard
    assert not events(r.run_dir, "instability") and r.rec.skipped == 0 and r.rec.consecutive == 0
    assert r.check(2, bad="nan") is False
    assert [e["step"] for e in events(r.run_dir, "step_skipped")] == [2]


def test_warn_on_nonfinite_gradients_becomes_skip_but_warn_on_a_spike_applies(rig):
    r = rig(inst={"nonfinite_grad": "warn", "loss_spike": "warn", "min_history": 2, "window": 10})
    assert r.check(1, bad="grad_inf") is False  # loss finite, one gradient overflowed: never applied
    (ev,) = events(r.run_dir, "instability")
    assert ev["details"]["detectors"] == ["nonfinite_grad"] and ev["details"]["policies"] == {"nonfinite_grad": "warn"}
    assert ev["details"]["action"] == "skip" and ev["details"]["why"] == "non-finite gradients are never applied"
    with pytest.raises(SkippedStepError):
        r.opt.step()
    for step in (2, 3):
        assert r.check(step) is True
    assert r.check(4, loss_scale=1000.0) is True  # a loss spike under 'warn': applied, and counted
    spike = events(r.run_dir, "instability")[-1]
    assert spike["details"]["detectors"] == ["loss_spike"] and spike["details"]["action"] == "warn"
    assert len(r.rec.detector.loss_stats) == 3 and r.rec.consecutive == 0 and r.rec.skipped == 1
    r.opt.step()
    assert [e["step"] for e in events(r.run_dir, "step_skipped")] == [1]


@pytest.mark.parametrize("depth, at_most", [(0, 33), (1, 33), (5, 29)])
def test_max_consecutive_skips_escalate_to_a_rollback_at_most_from_step_minus_depth(rig, depth, at_most):
    r = rig(inst={"max_consecutive": 3}, rb={"depth": depth})
    assert r.check(30, bad="nan") is False
    assert r.check(31) is True  # a healthy step in between starts the count again
    assert r.check(32, bad="nan") is False and r.check(33, bad="nan") is False
    decision = r.check(34, bad="grad_inf")
    assert decision == Rollback(from_step=34, at_most=at_most, detectors=["nonfinite_grad"])
    assert all(p.grad is None for p in r.model.parameters()) and r.rec.rejected
    with pytest.raises(SkippedStepError):
        r.opt.step()
    last = events(r.run_dir, "instability")[-1]["details"]
    assert last["action"] == "rollback" and last["consecutive"] == 3
    assert last["why"] == "3 consecutive skipped steps (max_consecutive=3)"
    assert [e["step"] for e in events(r.run_dir, "step_skipped")] == [30, 32, 33]


def test_escalate_raise_gives_up_with_the_instability_give_up_event(rig):
    r = rig(inst={"max_consecutive": 2, "escalate": "raise"})
    assert r.check(7, bad="nan") is False
    with pytest.raises(GiveUp) as e:
        r.check(8, bad="nan")
    assert e.value.exit_code == ExitCode.GIVE_UP == 76 and e.value.reason == "instability"
    assert "2 consecutive skipped steps (max_consecutive=2)" in e.value.message
    (give_up,) = events(r.run_dir, "instability_give_up")
    assert give_up["step"] == 8 and give_up["details"]["reason"] == "2 consecutive skipped steps (max_consecutive=2)"
    assert all(p.grad is None for p in r.model.parameters())


def test_policy_raise_gives_up_at_once(rig):
    r = rig(inst={"nonfinite_loss": "raise"})
    with pytest.raises(GiveUp):
        r.check(12, bad="nan")
    (give_up,) = events(r.run_dir, "instability_give_up")
    assert give_up["step"] == 12
    assert give_up["details"]["reason"] == "policy 'raise' for nonfinite_loss, nonfinite_grad"
    assert not events(r.run_dir, "step_skipped")


@pytest.mark.parametrize("earlier, budget, gives_up", [(0, 0, True), (1, 2, False), (2, 2, True)])
def test_the_rollback_budget_counts_the_runs_ledger(rig, earlier, budget, gives_up):
    r = rig(inst={"nonfinite_loss": "rollback", "max_rollbacks": budget})
    for i in range(earlier):  # rollbacks of earlier launches of the run
        append_ledger(r.run_dir, {"from_step": 10 + i, "to_step": 5})
    r.rec.on_start()
    assert r.rec.rollbacks == earlier
    if not gives_up:
        assert isinstance(r.check(15, bad="nan"), Rollback)
        return
    with pytest.raises(GiveUp):
        r.check(15, bad="nan")
    (give_up,) = events(r.run_dir, "instability_give_up")
    assert give_up["details"]["reason"] == f"rollback budget spent ({earlier} of max_rollbacks={budget})"
    assert give_up["details"]["rollbacks"] == earlier


# ------------------------------------------------------------------------------------------------
# hooks


def spike_history(r: Rig) -> None:
    """Ten applied steps at the rig's loss (restored like a checkpoint's statistics): spikes are armed."""
    assert r.check(1) is True
    loss, grad = r.rec.detector.loss_stats.values[0], r.rec.detector.grad_stats.values[0]
    r.rec.detector.load_state_dict({"loss": [loss] * 10, "grad_norm": [grad] * 10})


@pytest.mark.parametrize(
    "policy, answers, bad, expected",
    [
        ("skip", ["rollback"], "spike", "rollback"),
        ("skip", [None], "spike", "skip"),
        ("rollback", ["skip"], "spike", "skip"),
        ("raise", ["warn"], "spike", "warn"),
        ("skip", ["rollback", "skip"], "spike", "skip"),  # every hook is asked; the last answer wins
        ("skip", ["rollback", None], "spike", "rollback"),
        ("skip", ["warn"], "nan", "skip"),  # non-finite gradients are never applied, whatever a hook says
        ("warn", [None], "nan", "skip"),
        ("skip", ["raise"], "nan", "raise"),
    ],
)
def test_hooks_override_the_policy(rig, policy, answers, bad, expected):
    hooks = tuple((lambda event, a=a: a) for a in answers)
    r = rig(
        inst={
            "loss_spike": policy,
            "nonfinite_loss": policy,
            "nonfinite_grad": policy,
            "min_history": 10,
            "window": 20,
        },
        hooks=hooks,
    )
    spike_history(r)
    step = (lambda: r.check(2, bad="nan")) if bad == "nan" else (lambda: r.check(2, loss_scale=1000.0))
    if expected == "raise":
        with pytest.raises(GiveUp):
            step()
    else:
        decision = step()
        if expected == "rollback":
            assert decision == Rollback(2, 1, events(r.run_dir, "instability")[-1]["details"]["detectors"])
        else:
            assert decision is (expected == "warn")
    decided = "skip" if policy == "warn" and bad == "nan" else policy  # the policy's decision
    (heard,) = r.heard  # the hooks were asked once, with it
    assert heard["step"] == 2 and heard["action"] == decided
    ev = events(r.run_dir, "instability")[-1]["details"]
    assert (
        ev["detectors"] == heard["detectors"]
        and ev["action"] == expected
        and ev["hook_override"] is (expected != decided)
    )


def test_a_hooks_rollback_past_the_budget_gives_up(rig):
    r = rig(inst={"max_rollbacks": 0}, hooks=(lambda event: "rollback",))
    with pytest.raises(GiveUp):
        r.check(3, bad="nan")
    (give_up,) = events(r.run_dir, "instability_give_up")
    assert give_up["details"]["reason"] == "rollback budget spent (0 of max_rollbacks=0)"


def test_a_hooks_unknown_answer_is_refused(rig):
    r = rig(hooks=(lambda event: None, lambda event: "explode"))
    with pytest.raises(ValueError, match="'explode'"):
        r.check(3, bad="nan")


# ------------------------------------------------------------------------------------------------
# the rollback target


@pytest.mark.parametrize(
    "from_step, depth, target",
    [
        (41, 0, 30),  # at most 40: 40 is not known-good
        (31, 0, 30),  # at most 30: inclusive
        (30, 0, 20),  # at most 29
        (31, 1, 30),  # depth 1 is the default's one step
        (31, 2, 20),
        (45, 15, 30),
        (45, 16, 20),
        (11, 0, 10),
    ],
)
def test_rollback_target_is_the_newest_known_good_at_or_before_from_step_minus_depth(rig, from_step, depth, target):
    r = rig(inst={"nonfinite_loss": "rollback"}, rb={"depth": depth})
    for step in (10, 20, 30):
        commit(r.store, step, known_good=True)
    commit(r.store, 40)  # committed, no verdict yet
    decision = r.check(from_step, bad="nan")
    assert isinstance(decision, Rollback) and decision.at_most == from_step - max(1, depth)
    assert r.rec.rollback_target(decision) == Checkpoint(target, r.store.path_for(target))


def test_no_known_good_checkpoint_to_roll_back_to_gives_up(rig):
    r = rig(inst={"nonfinite_loss": "rollback"})
    commit(r.store, 10, known_good=True)
    commit(r.store, 12)
    decision = r.check(11, bad="nan")
    assert decision.at_most == 10
    r.store.set_aside(Checkpoint(10, r.store.path_for(10)), "test")  # gone meanwhile
    with pytest.raises(GiveUp) as e:
        r.rec.rollback_target(decision)
    assert e.value.exit_code == 76
    (give_up,) = events(r.run_dir, "instability_give_up")
    assert give_up["step"] == 11 and give_up["details"]["detectors"] == ["nonfinite_loss", "nonfinite_grad"]
    assert give_up["details"]["reason"] == "no known-good checkpoint at or before step 10 to roll back to"


@pytest.mark.parametrize("verify, target", [("full", 20), ("size", 30)])
def test_a_corrupt_known_good_checkpoint_is_passed_over_as_verify_says(rig, verify, target):
    r = rig(verify=verify)
    for step in (10, 20, 30):
        commit(r.store, step, known_good=True)
    flip_byte(r.store.path_for(30) / "data")  # same size, other bytes
    assert r.rec.rollback_target(Rollback(35, 34, ["loss_spike"])).step == target


# ------------------------------------------------------------------------------------------------
# after the rollback: data position, ramp, set-aside, ledger; a later launch applies the record


def test_rolled_back_skips_the_data_starts_the_ramp_sets_newer_aside_and_a_resume_reapplies_it(rig):
    r = rig(rb={"skip_batches": 20, "lr_factor": 0.25, "lr_ramp_steps": 8})
    for step in (10, 20):
        commit(r.store, step, known_good=True)
    for step in (30, 34):
        r.rec.on_commit(commit(r.store, step))
    for _ in range(35):  # the batches of steps 1..35: 35 was bad
        r.sampler.take(4)
    position = r.sampler.state_dict()
    target = r.rec.rollback_target(Rollback(35, 34, ["nonfinite_loss"]))
    r.sampler.load_state_dict({"epoch": 0, "consumed": 20 * 4})  # what loading checkpoint 20 restores
    r.rec.rolled_back(Rollback(35, 34, ["nonfinite_loss"]), target, position, lr_before=0.1)

    # batches 21..35 were the window between checkpoint and bad step; skip_batches=20 skips 36..40 too
    assert r.sampler.state_dict() == {"epoch": 0, "consumed": 40 * 4}
    order = ResumableSampler(1000, seed=0)
    assert r.sampler.take(4) == [order.take(4) for _ in range(41)][-1]
    assert [r.rec.ramp.multiplier(s) for s in (21, 25, 29, 30)] == [0.25, 0.25 + 0.75 * 4 / 8, 1.0, 1.0]
    assert [c.step for c in r.store.committed()] == [10, 20]
    assert (
        sorted(p.name.split("-step-")[0] for p in r.store.root.iterdir() if p.name.startswith("."))
        == [".rolledback"] * 2
    )
    assert r.rec.rollbacks == 1 and r.rec.newest_known_good == 20 and r.rec.pending == [] and r.rec.rejected
    (record,) = read_ledger(r.run_dir)
    assert record["from_step"] == 35 and record["to_step"] == 20 and record["checkpoint"] == f"20@{1_000_020}"
    assert record["skipped_batches"] == 20 and record["skipped_window"] == [21, 40]
    assert record["sampler_states"] == [{"epoch": 0, "consumed": 160}]
    (ev,) = events(r.run_dir, "rollback")
    d = ev["details"]
    assert ev["step"] == 35 and d["set_aside"] == [30, 34] and d["skipped_window"] == [21, 40]
    assert d["lr_before"] == 0.1 and d["lr_after"] == pytest.approx(0.1 * 0.25) and d["rollbacks"] == 1

    assert checkpoint_id(target) == record["checkpoint"] and (r.run_dir / LEDGER).exists()

    # a later launch (fresh objects) that resumes from checkpoint 20 applies the same skip and ramp
    later = rig(run_dir=r.run_dir, rb={"skip_batches": 20, "lr_factor": 0.25, "lr_ramp_steps": 8})
    later.rec.on_start()
    assert later.rec.rollbacks == 1 and later.rec.newest_known_good == 20
    later.sampler.load_state_dict({"epoch": 0, "consumed": 80})
    later.rec.on_resume(target)
    assert later.sampler.state_dict() == {"epoch": 0, "consumed": 160}
    assert later.rec.ramp.multiplier(21) == 0.25 and later.rec.ramp.multiplier(29) == 1.0
    (resumed,) = events(r.run_dir, "rollback_resumed")
    assert resumed["details"]["skipped_window"] == [21, 40]
    # one that resumes from another checkpoint: the record is not applied
    other = rig(run_dir=r.run_dir)
    other.sampler.load_state_dict({"epoch": 0, "consumed": 40})
    other.rec.on_resume(r.store.committed()[0])
    assert other.sampler.state_dict() == {"epoch": 0, "consumed": 40} and other.rec.ramp.multiplier(11) == 1.0


# ------------------------------------------------------------------------------------------------
# the learning-rate ramp


def m(s: int, k: int, factor: float, steps: int) -> float:
    """The ramp's formula (lr_ramp.py): lr_factor + (1 - lr_factor) · min(1, (s - K - 1) / lr_ramp_steps)."""
    return 1.0 if steps == 0 else factor + (1 - factor) * min(1.0, (s - k - 1) / steps)


@pytest.mark.parametrize("k, factor, steps", [(20, 0.25, 8), (0, 0.5, 1), (100, 0.1, 37), (7, 0.5, 0), (3, 1.0, 5)])
def test_ramp_multiplier_follows_the_formula(k, factor, steps):
    ramp = LRRamp(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), lambda: 0)
    assert ramp.multiplier(k + 1) == 1.0  # no ramp yet
    ramp.begin(k, factor, steps)
    got = [ramp.multiplier(s) for s in range(k + 1, k + steps + 5)]
    assert got == pytest.approx([m(s, k, factor, steps) for s in range(k + 1, k + steps + 5)], abs=1e-15)
    assert got[0] == (factor if steps else 1.0) and got[-1] == 1.0
    assert all(a <= b for a, b in zip(got, got[1:]))
    ramp.close()


@pytest.mark.parametrize(
    "make_sched",
    [
        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),  # chainable: reads group["lr"]
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.3 * s)),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    ],
    ids=["exponential", "lambda", "step"],
)
def test_ramp_scales_the_update_and_the_scheduler_never_sees_it(make_sched):
    """Two optimizers from the same start, one with a ramp after a rollback to K = 10: each
    parameter update is exactly the scheduler's rate × m(s); the scheduler's rates are the same."""
    k, factor, steps = 10, 0.25, 6

    def build():
        w1, w2 = (
            torch.nn.Parameter(torch.ones(3, dtype=torch.float64)),
            torch.nn.Parameter(torch.ones(2, dtype=torch.float64)),
        )
        opt = torch.optim.SGD([{"params": [w1], "lr": 0.5}, {"params": [w2], "lr": 0.05}], lr=0.5)
        return (w1, w2), opt, make_sched(opt)

    step = {"s": k + 1}
    (a1, a2), plain_opt, plain_sched = build()
    (b1, b2), ramp_opt, ramp_sched = build()
    ramp = LRRamp(ramp_opt, lambda: step["s"])
    ramp.begin(k, factor, steps)
    grad = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), torch.tensor([3.0, 1.0], dtype=torch.float64)]
    for s in range(k + 1, k + steps + 4):
        step["s"] = s
        rates = [g["lr"] for g in ramp_opt.param_groups]
        assert rates == [g["lr"] for g in plain_opt.param_groups]  # the scheduler's own rate, unscaled
        for (p, q), g in zip(((a1, b1), (a2, b2)), grad):
            p.grad, q.grad = g.clone(), g.clone()
        before = [b1.detach().clone(), b2.detach().clone()]
        plain_opt.step()
        ramp_opt.step()
        used = [((x - y.detach()) / g) for x, y, g in zip(before, (b1, b2), grad)]
        for lr_used, rate in zip(used, rates):  # SGD: Δp = -lr · grad
            assert torch.allclose(lr_used, torch.full_like(lr_used, rate * m(s, k, factor, steps)), rtol=1e-12, atol=0)
        assert [g["lr"] for g in ramp_opt.param_groups] == rates  # restored by the post-hook
        plain_sched.step()
        ramp_sched.step()
    assert ramp.start is None  # the ramp ended once past K + 1 + lr_ramp_steps
    ramp.close()
    assert ramp.state_dict() == {"start": None, "factor": factor, "steps": steps}


def test_ramp_state_round_trips_and_close_removes_the_hooks():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    step = {"s": 13}
    ramp = LRRamp(opt, lambda: step["s"])
    ramp.begin(10, 0.5, 4)
    again = LRRamp(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), lambda: 0)
    again.load_state_dict(ramp.state_dict())
    assert [again.multiplier(s) for s in range(11, 16)] == [ramp.multiplier(s) for s in range(11, 16)]
    ramp.close()
    ramp.close()  # twice is harmless
    p.grad = torch.ones(1)
    opt.step()
    assert p.item() == -1.0  # no hook: the full rate
    again.close()


def test_a_refused_optimizer_step_leaves_the_learning_rate_unscaled(rig):
    r = rig(rb={"lr_factor": 0.5, "lr_ramp_steps": 10})
    r.rec.ramp.begin(20, 0.5, 10)
    assert r.check(21, bad="nan") is False
    with pytest.raises(SkippedStepError):
        r.opt.step()
    assert r.opt.param_groups[0]["lr"] == 0.1


# ------------------------------------------------------------------------------------------------
# the Guard carries a rollback out (one process, world size 1)


class RollbackHook(trainguard.Hook):
    def __init__(self, answer: Optional[str] = None):
        self.answer, self.heard = answer, []

    def on_instability(self, guard, event):
        return self.answer

    def on_rollback(self, guard, from_step, to_step):
        self.heard.append((from_step, to_step, guard.step))


BASE = (
    "checkpoint.interval=20",
    "checkpoint.async_save=false",  # the known-good verdicts at exact steps (a background commit lands later)
    "instability.known_good_after=5",
    "instability.min_history=10",
    "health.preflight=false",
)


def train(
    run_dir: Path,
    max_steps: int,
    *overrides: str,
    crash_at: Optional[int] = None,
    hook: Optional[trainguard.Hook] = None,
) -> tuple[list[dict], Optional[str]]:
    """The instability worker's regression, in this process under a Guard. Returns one record per
    step run (number, batch, applied, learning rate used and the scheduler's) and the end state hash.
    ``crash_at``: raise before step number ``crash_at`` runs (a crash: no save, no exit event)."""
    cfg = trainguard.load_config(None, [f"run.dir={run_dir}", *BASE, *overrides])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(2000, 1, generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.02 * s))
    sampler = ResumableSampler(2000, seed=0)
    seen: dict[str, float] = {}
    records: list[dict] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with trainguard.Guard(
            cfg, model=model, optimizer=opt, scheduler=sched, sampler=sampler, hooks=[hook] if hook else []
        ) as guard:
            opt.register_step_pre_hook(lambda o, a, k: seen.__setitem__("lr", o.param_groups[0]["lr"]))
            for step in guard.steps(max_steps):
                if step + 1 == crash_at:
                    raise RuntimeError("crash")
                idx = sampler.take(4)
                loss = F.mse_loss(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                seen.clear()
                sched_lr = sched.get_last_lr()[0]
                applied = guard.should_step(loss)
                if applied:
                    opt.step()
                    sched.step()
                records.append(
                    {
                        "step": step + 1,
                        "indices": idx,
                        "applied": applied,
                        "lr_seen": seen.get("lr"),
                        "sched_lr": sched_lr,
                    }
                )
                guard.step_end(loss=loss.detach())
        return records, guard.state_sha256


NANS = 'faults.inject=[{kind="nan_loss", rank=0, step=33, repeat=3}]'
RAMP = ("rollback.lr_ramp_steps=8", "rollback.lr_factor=0.25", "rollback.skip_batches=20")


def test_guard_rolls_back_in_process_with_ramp_and_data_skip_and_a_crash_after_it_resumes_alike(tmp_path):
    run = tmp_path / "run"
    recs, digest = train(run, 60, NANS, *RAMP)
    (rb,) = events(run, "rollback")
    # NaN at 33, 34, 35: the third in a row escalates; step 20 became known-good at step 25
    assert rb["details"]["from_step"] == 35 and rb["details"]["to_step"] == 20
    assert [e["step"] for e in events(run, "checkpoint_known_good")][:1] == [25]
    assert read_manifest(run / "checkpoints" / "step-00000020")["known_good"]["healthy_steps"] == 5
    first, second = recs[:35], recs[35:]
    assert [r["step"] for r in first] == list(range(1, 36)) and [r["step"] for r in second] == list(range(21, 61))
    assert [r["applied"] for r in first[32:]] == [False] * 3 and all(r["applied"] for r in first[:32] + second)
    for r in second:  # the rate used: the scheduler's × (0.25 + 0.75 · min(1, (s - 21) / 8))
        assert r["lr_seen"] == pytest.approx(r["sched_lr"] * m(r["step"], 20, 0.25, 8), rel=1e-12, abs=0), r
    order = ResumableSampler(2000, seed=0)
    batches = [order.take(4) for _ in range(80)]
    assert [r["indices"] for r in first] == batches[:35] and [r["indices"] for r in second] == batches[40:80]

    # the same run, crashed at step 36 (reached after the rollback; no checkpoint since), then a new
    # Guard in the same run dir (without the fault): resumes from 20, applies the recorded skip and ramp
    again = tmp_path / "again"
    with pytest.raises(RuntimeError, match="crash"):
        train(again, 60, NANS, *RAMP, crash_at=36)
    recs2, digest2 = train(again, 60, *RAMP)
    (resumed,) = events(again, "rollback_resumed")
    assert resumed["details"]["skipped_window"] == [21, 40]
    assert [r["indices"] for r in recs2] == batches[40:80]
    assert [r["lr_seen"] for r in recs2] == [r["lr_seen"] for r in second]
    assert digest2 == digest


def test_a_background_commit_after_a_bad_step_is_still_known_good_when_its_own_steps_were(tmp_path):
    """The save of step 20 is written in the background (tiny steps: its commit lands after step 26,
    where a NaN asks for a rollback): 21–25 were healthy, so the rollback finds it known-good (the
    verdict counts the steps after the checkpoint, not the time its commit landed)."""
    run = tmp_path / "run"
    nan = 'faults.inject=[{kind="nan_loss", rank=0, step=26}]'
    recs, _ = train(run, 30, "checkpoint.async_save=true", "instability.nonfinite_loss=rollback", nan)
    (saved,) = [e for e in events(run, "checkpoint_committed") if e["details"]["reason"] == "interval"]
    assert saved["details"]["asynchronous"] is True and saved["step"] == 20
    (rb,) = events(run, "rollback")
    assert rb["details"]["from_step"] == 26 and rb["details"]["to_step"] == 20
    assert [r["step"] for r in recs] == list(range(1, 27)) + list(range(21, 31))


def test_guard_asks_the_hook_and_tells_it_of_the_rollback(tmp_path):
    run = tmp_path / "run"
    hook = RollbackHook("rollback")
    train(run, 40, "checkpoint.interval=10", 'faults.inject=[{kind="nan_loss", rank=0, step=32}]', hook=hook)
    (ev,) = events(run, "instability")
    assert ev["details"]["action"] == "rollback" and ev["details"]["hook_override"] is True
    # step 30 is not known-good at step 32 (needs 5 healthy steps): back to 20, 30 set aside
    assert hook.heard == [(32, 20, 20)]
    (rb,) = events(run, "rollback")
    assert rb["details"]["set_aside"] == [30]


@pytest.mark.parametrize(
    "overrides, fault, reason, rollbacks",
    [
        (("instability.nonfinite_loss=raise",), "step=12", "policy 'raise'", 0),
        (
            ("instability.nonfinite_loss=rollback", "instability.max_rollbacks=2"),
            "step=28, persistent=true",
            "rollback budget spent (2 of max_rollbacks=2)",
            2,
        ),
    ],
)
def test_guard_gives_up_with_76_and_says_why(tmp_path, overrides, fault, reason, rollbacks):
    run = tmp_path / "run"
    with pytest.raises(GiveUp) as e:
        train(run, 60, *overrides, f'faults.inject=[{{kind="nan_loss", rank=0, {fault}}}]')
    assert e.value.exit_code == 76
    assert [ev["details"]["to_step"] for ev in events(run, "rollback")] == [20] * rollbacks
    (give_up,) = events(run, "instability_give_up")
    assert reason in give_up["details"]["reason"]
    (exit_ev,) = events(run, "exit")
    assert exit_ev["details"]["code"] == 76 and exit_ev["details"]["reason"] == "instability"
    assert not dist.is_initialized()  # the Guard left as a real run does: group destroyed
