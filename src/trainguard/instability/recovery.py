"""What ``guard.should_step(loss, grad_norm)`` does: detect, decide, skip or roll back.

Per step (see :mod:`.detect`): one collective, one host sync, then on every rank the same
decision. A healthy step returns ``True`` (apply ``optimizer.step()`` and ``scheduler.step()``).
Otherwise the most severe policy among the detectors that fired decides (``warn`` < ``skip`` <
``rollback`` < ``raise``), with three rules on top:

1. non-finite gradients are never applied: ``warn`` becomes ``skip``;
2. after ``max_consecutive`` skipped steps in a row the action becomes ``escalate``;
3. hooks may override (``Hook.on_instability(guard, event) -> action``), rank 0's answer wins;
   a rollback past ``max_rollbacks`` gives up (:class:`~trainguard.outcomes.GiveUp`, exit 76) instead.

:meth:`Recovery.check` returns ``True`` (apply the step), ``False`` (skipped) or a
:class:`Rollback` decision, which the Guard carries out (it owns loading a checkpoint) with
:meth:`Recovery.rollback_target` and :meth:`Recovery.rolled_back`; it raises ``GiveUp``.
Step numbers here are 1-based step numbers: the step in progress after ``guard.step`` completed
ones is number ``guard.step + 1`` (see :mod:`trainguard.guard`).

A **rollback** from the bad step S (1-based) reloads the newest known-good checkpoint K with
``K <= S - max(1, depth)`` in the same processes, skips the S - K batches between K and S (more
with ``skip_batches``), sets aside (renames, never deletes) the checkpoints newer than K, starts
the learning-rate ramp (:mod:`.lr_ramp`) and appends a record to ``RUN_DIR/rollbacks.json``. The
record holds each rank's data position after the skip: a launch that later resumes from K
applies it, so the skipped batches stay skipped across restarts.

A checkpoint becomes **known-good** when the ``known_good_after`` steps after it had no detection;
rank 0 then records it in the checkpoint's manifest (:meth:`CheckpointStore.mark_known_good`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from .. import console
from .. import dist as tgdist
from ..atomic import write_atomic
from ..checkpoint import manifest as mf
from ..checkpoint.store import Checkpoint, CheckpointStore
from ..events import EventLog
from ..outcomes import GiveUp
from ..ranks import RankView
from ..sections import InstabilitySection, RollbackSection
from .detect import Detector, Verdict, total_grad_norm
from .fold import LossFold
from .lr_ramp import LRRamp

BAD_STEPS_KEPT = 1024  # recent bad steps remembered for the known-good verdicts (a few kB in the rank state)

SEVERITY = {"warn": 0, "skip": 1, "rollback": 2, "raise": 3}
LEDGER = "rollbacks.json"


class SkippedStepError(RuntimeError):
    """``optimizer.step()`` was called in a step that ``should_step()`` rejected."""


def read_ledger(run_dir: Path) -> list[dict]:
    """The rollback records of the run (``RUN_DIR/rollbacks.json``), oldest first; [] if none."""
    try:
        return json.loads((run_dir / LEDGER).read_text())["rollbacks"]
    except FileNotFoundError:
        return []


def append_ledger(run_dir: Path, record: dict) -> None:
    """Append a rollback record, atomically (temp file, fsync, rename)."""
    write_atomic(run_dir / LEDGER, json.dumps({"rollbacks": read_ledger(run_dir) + [record]}, indent=1))


def _manifest_or_empty(ckpt: Checkpoint) -> dict:
    """``ckpt``'s manifest, or ``{}`` when it is gone or unreadable (retention may delete it meanwhile)."""
    try:
        return mf.read_manifest(ckpt.path)
    except (OSError, ValueError):
        return {}


def checkpoint_id(ckpt: Checkpoint) -> str:
    """``step@created``: tells a checkpoint from a later one saved at the same step."""
    return f"{ckpt.step}@{mf.read_manifest(ckpt.path)['meta'].get('created')}"


@dataclass
class Rollback:
    """Decision: step number ``from_step`` was bad; roll back to a known-good checkpoint at or
    before step ``at_most``. ``detectors``: what fired."""

    from_step: int
    at_most: int
    detectors: list[str]


@dataclass(frozen=True)
class Settings:
    """How a :class:`Recovery` decides and where it keeps its ledger.

    Attributes:
        instability, rollback: the ``[instability]`` and ``[rollback]`` sections.
        run_dir: where ``rollbacks.json`` lives (the run directory).
        verify: ``[checkpoint] verify``: how a rollback target is checked (``full`` or ``size``).
        loss_scaler: an enabled ``torch.amp.GradScaler`` is in use (fp16): non-finite gradients
            under a finite loss are its routine overflow, which ``scaler.step`` skips and answers
            by lowering the scale; they are not an instability (no event, no skip counted).
    """

    instability: InstabilitySection
    rollback: RollbackSection
    run_dir: Path
    verify: str = "full"
    loss_scaler: bool = False


@dataclass(frozen=True)
class Trained:
    """What skips and rollbacks act on: the model (gradients zeroed), the optimizer (hooked;
    ``None``: absent) and the data position (repositioned; ``None``: absent)."""

    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer] = None
    sampler: Any = None


class Recovery:
    """Instability detection and recovery for one rank (every rank builds one; they decide alike).

    Args:
        settings: the sections, the ledger's directory, the checks (:class:`Settings`).
        trained: the model, optimizer and data position skips and rollbacks act on (:class:`Trained`).
        store: the persistent checkpoint store (known-good checkpoints).
        events: the rank's event log (rank 0 writes the decisions).
        world: this rank and the group size, read at each use (:class:`~trainguard.ranks.RankView`:
            the Guard's shared world, which a shrink changes; the detectors and the fold read it too).
        current_step: returns the step number in progress (1-based), for the learning-rate ramp.
        ask_hooks: given the ``instability`` event, returns each hook's answer (``[]`` without hooks).
        fold: where the detectors' values ride in the step's collective (:mod:`.fold`; the Guard's,
            which the stop check, the replica check and the straggler report share, and which its
            owner closes); default: one of this recovery's own (never carried: an all-reduce a step).
    """

    def __init__(
        self,
        settings: Settings,
        trained: Trained,
        store: CheckpointStore,
        events: EventLog,
        world: RankView,
        current_step: Callable[[], int],
        ask_hooks: Callable[[dict], list[Optional[str]]] = lambda event: [],
        fold: Optional[LossFold] = None,
    ):
        cfg, optimizer = settings.instability, trained.optimizer
        self.cfg, self.rb, self.verify, self.loss_scaler = cfg, settings.rollback, settings.verify, settings.loss_scaler
        self.model, self.optimizer, self.sampler, self.store, self.events = (
            trained.model,
            optimizer,
            trained.sampler,
            store,
            events,
        )
        self.run_dir, self.world, self.current_step, self.ask_hooks = settings.run_dir, world, current_step, ask_hooks
        self.detector = Detector(cfg, world)
        self.fold = fold if fold is not None else LossFold(world)
        self._said_unfolded = False
        # the refusal runs before the ramp's pre-hook: a refused step must not leave the rate scaled
        self._hook = optimizer.register_step_pre_hook(self._refuse_rejected_step) if optimizer is not None else None
        self.ramp = LRRamp(optimizer, current_step) if optimizer is not None else None
        self.consecutive = 0  # skipped steps in a row
        self.skipped = 0  # skipped steps in this run's history (saved in checkpoints)
        self.rollbacks = 0  # rollbacks in the whole run (from the ledger)
        # step numbers of the recent steps with a detection (the newest BAD_STEPS_KEPT): a checkpoint
        # is known-good when none falls in the known_good_after steps after it, whenever its commit
        # lands (a background save may commit after a later step was bad)
        self.bad_steps: list[int] = []
        self.rejected = False  # the current step must not be applied
        self.pending: list[Checkpoint] = []  # rank 0: committed, known-good verdict pending
        self._unmarked: set[int] = set()  # steps whose known-good mark could not be written (warned once)
        self.newest_known_good: Optional[int] = None  # rank 0: protected from retention

    # ------------------------------------------------------------------------------------------
    # the per-step check

    def check(self, step: int, loss: Any, grad_norm: Any = None) -> Union[bool, Rollback]:
        """Run the detectors on step number ``step`` and decide (a collective).

        Returns:
            ``True``: apply the step; ``False``: skipped (gradients zeroed, ``optimizer.step()``
            refused); a :class:`Rollback` for the Guard to carry out.
        Raises:
            GiveUp: policy ``raise``, or the rollback budget is spent.
            ValueError: a hook answered an unknown action.
        """
        return self.decide(self.observe(step, loss, grad_norm))

    def observe(self, step: int, loss: Any, grad_norm: Any = None) -> Verdict:
        """Run the detectors on step number ``step`` (a collective) and return their verdict,
        without acting on it (:meth:`decide` does; :meth:`check` is both)."""
        if grad_norm is None:
            grad_norm = total_grad_norm(self.model.parameters())
        self.rejected = False
        if not self.fold.wired and self.world.world_size > 1 and self.world.rank == 0 and not self._said_unfolded:
            self._said_unfolded = True
            console.say(
                "should_step() all-reduces the detectors' values once a step: they ride in the gradient "
                "all-reduce of a DDP model with trainguard's communication hook, or in clip_grad_norm_'s "
                "all-reduce of an FSDP2 model on a 1-D mesh of every rank (not HSDP, not a plain module, "
                "not a DDP hook of the script's own)"
            )
        return self.detector.observe(step, loss, grad_norm, self.fold if self.fold.wired else None)

    def unstable(self, verdict: Verdict) -> bool:
        """Whether ``verdict`` is an instability that :meth:`decide` acts on (an enabled
        GradScaler's routine overflow is not)."""
        return not verdict.healthy and not (self.loss_scaler and verdict.fired == ["nonfinite_grad"])

    def decide(self, verdict: Verdict) -> Union[bool, Rollback]:
        """Act on ``verdict`` (see :meth:`check`; identical on every rank, hooks aside)."""
        if not self.unstable(verdict):
            if verdict.healthy:
                self.consecutive = 0
                self.detector.record_applied(verdict)
            return True  # healthy, or the GradScaler's overflow: scaler.step() skips the step itself
        step = verdict.step
        self.bad_steps = [*self.bad_steps[-(BAD_STEPS_KEPT - 1) :], step]
        action, why = self._decide(verdict)
        event = self._event(verdict, action, why)
        action = self._hook_override(event, verdict)
        if action == "warn":
            self.consecutive = 0
            self.detector.record_applied(verdict)
            return True
        if action == "skip":
            self.skipped += 1
            self._reject()
            self._emit(step, "step_skipped", skipped_total=self.skipped, consecutive=self.consecutive)
            return False
        if action == "rollback" and self.rollbacks >= self.cfg.max_rollbacks:
            action, why = "raise", f"rollback budget spent ({self.rollbacks} of max_rollbacks={self.cfg.max_rollbacks})"
        if action == "rollback":
            self._reject()
            return Rollback(step, step - max(1, self.rb.depth), verdict.fired)
        self._give_up(step, verdict.fired, why or f"policy 'raise' for {', '.join(verdict.fired)}")

    def _decide(self, v: Verdict) -> tuple[str, str]:
        policies = {d: getattr(self.cfg, d) for d in v.fired}
        action = max(policies.values(), key=SEVERITY.__getitem__)
        why = ""
        if action == "warn" and "nonfinite_grad" in v.fired:
            action, why = "skip", "non-finite gradients are never applied"
        if action == "skip":
            self.consecutive += 1
            if self.consecutive >= self.cfg.max_consecutive:
                action = self.cfg.escalate
                why = f"{self.consecutive} consecutive skipped steps (max_consecutive={self.cfg.max_consecutive})"
        return action, why

    def _event(self, v: Verdict, action: str, why: str) -> dict:
        return {
            "step": v.step,
            "detectors": v.fired,
            "loss": v.loss,
            "grad_norm": v.grad_norm,
            "thresholds": v.thresholds,
            "nonfinite_ranks": v.nonfinite_ranks,
            "ranks": v.ranks,
            "policies": {d: getattr(self.cfg, d) for d in v.fired},
            "action": action,
            "why": why,
            "consecutive": self.consecutive,
            "running": v.details,
        }

    def _hook_override(self, event: dict, v: Verdict) -> str:
        action = event["action"]
        answers = self.ask_hooks(dict(event))
        for answer in answers:
            if answer is not None:
                if answer not in SEVERITY:
                    raise ValueError(
                        f"a hook's on_instability returned {answer!r}; expected one of {sorted(SEVERITY)} or None"
                    )
                action = answer
        if answers:
            action = tgdist.broadcast_object(action)  # hooks may differ by rank: rank 0 decides
        if action == "warn" and "nonfinite_grad" in v.fired:
            action = "skip"
        event.update(action=action, hook_override=action != event["action"])
        self._emit(v.step, "instability", **{k: x for k, x in event.items() if k != "step"})
        return action

    def _reject(self) -> None:
        """Zero the gradients and refuse ``optimizer.step()`` for this step."""
        self.rejected = True
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def refuse(self) -> None:
        """Refuse the current step (gradients zeroed, ``optimizer.step()`` raises) without a
        detection: in-process recovery abandons a step whose collective lost a peer."""
        self._reject()

    def release(self) -> None:
        """Let ``optimizer.step()`` run in this refused step, for a framework that calls it whatever
        a callback decided (the Hugging Face Trainer). The refusal zeroed the gradients to ``None``,
        so torch's optimizers leave every parameter and its optimizer state alone."""
        self.rejected = False

    def step_end(self, step: int) -> None:
        """``guard.step_end()`` of step ``step`` (the Guard's component protocol): the next step
        may be applied again."""
        self.rejected = False

    def _refuse_rejected_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.rejected:
            raise SkippedStepError(
                f"optimizer.step() called in step {self.current_step()}, which guard.should_step() "
                "rejected (skip or rollback): call it only when should_step() returns True"
            )

    def _give_up(self, step: int, detectors: list[str], why: str) -> None:
        self._reject()
        self._emit(step, "instability_give_up", detectors=detectors, reason=why, rollbacks=self.rollbacks)
        raise GiveUp("instability", f"instability: {why}")

    # ------------------------------------------------------------------------------------------
    # rollback (carried out by the Guard: wait for saves, rollback_target, load it, rolled_back)

    def rollback_target(self, rb: Rollback) -> Checkpoint:
        """The newest known-good checkpoint at or before ``rb.at_most`` (a collective; rank 0 looks).

        Raises:
            GiveUp: there is none.
        """
        target = self.store.known_good(self.verify, rb.at_most) if self.world.rank == 0 else None
        target = tgdist.broadcast_object(target)
        if target is None:
            self._give_up(
                rb.from_step, rb.detectors, f"no known-good checkpoint at or before step {rb.at_most} to roll back to"
            )
        return target

    def rolled_back(self, rb: Rollback, target: Checkpoint, position: Any, lr_before: Optional[float]) -> None:
        """After the Guard loaded ``target``: put the data position back to ``position`` (where it
        was after the bad step's batch) and skip what ``[rollback] skip_batches`` adds, start the
        learning-rate ramp, set aside newer checkpoints, record the rollback (``rollbacks.json``,
        ``rollback`` event). A collective."""
        bad, window = rb.from_step, rb.from_step - target.step
        skip = max(self.rb.skip_batches, window)
        if self.sampler is not None:
            self.sampler.load_state_dict(position)
            if skip > window:
                self.sampler.skip_batches(skip - window)
        if self.ramp is not None:
            self.ramp.begin(target.step, self.rb.lr_factor, self.rb.lr_ramp_steps)
        self.rollbacks += 1
        self.consecutive = 0
        positions = tgdist.gather_objects(self.sampler.state_dict() if self.sampler is not None else None)
        lr_after = lr_before
        if self.optimizer is not None:
            lr_after = self.optimizer.param_groups[0]["lr"] * (
                self.ramp.multiplier(target.step + 1) if self.ramp else 1.0
            )
        if self.world.rank == 0:
            newer = self.store.set_aside_after(target.step, f"rolled back from step {bad} to {target.step}")
            self.pending = [c for c in self.pending if c.step <= target.step]
            record = {
                "time": round(time.time(), 3),
                "attempt": self.events.attempt,
                "from_step": bad,
                "to_step": target.step,
                "checkpoint": checkpoint_id(target),
                "detectors": rb.detectors,
                "skipped_batches": skip,
                "skipped_window": [target.step + 1, target.step + skip],
                "lr_factor": self.rb.lr_factor,
                "lr_ramp_steps": self.rb.lr_ramp_steps,
                "sampler_states": positions,
            }
            append_ledger(self.run_dir, record)
            self._emit(
                bad,
                "rollback",
                from_step=bad,
                to_step=target.step,
                path=str(target.path),
                detectors=rb.detectors,
                skipped_batches=skip,
                skipped_window=record["skipped_window"],
                set_aside=[c.step for c in newer],
                lr_before=lr_before,
                lr_after=lr_after,
                lr_factor=self.rb.lr_factor,
                lr_ramp_steps=self.rb.lr_ramp_steps,
                rollbacks=self.rollbacks,
                max_rollbacks=self.cfg.max_rollbacks,
            )
        self.newest_known_good = target.step
        self.bad_steps = [b for b in self.bad_steps if b <= target.step]  # the rest: the abandoned trajectory
        self._reject()

    def on_resume(self, ckpt: Checkpoint) -> None:
        """After the Guard loaded ``ckpt`` at start: if the run had rolled back to exactly this
        checkpoint, apply that rollback's data skip and learning-rate ramp (a collective)."""
        records, cid = (read_ledger(self.run_dir), checkpoint_id(ckpt)) if self.world.rank == 0 else (None, None)
        records, cid = tgdist.broadcast_object((records, cid))
        if self.world.rank == 0 and "known_good" not in mf.read_manifest(ckpt.path):
            self.pending.append(ckpt)
        last = next((r for r in reversed(records) if r["checkpoint"] == cid), None)
        if last is None:
            return
        states = last["sampler_states"]
        # recorded by every rank of the world then; a global (reshardable) state is the same on every rank
        mine = states[self.world.rank] if len(states) == self.world.world_size else states[0]
        if self.sampler is not None and mine is not None:
            self.sampler.load_state_dict(mine)
        if self.ramp is not None:
            self.ramp.begin(ckpt.step, last["lr_factor"], last["lr_ramp_steps"])
        self._emit(
            ckpt.step,
            "rollback_resumed",
            to_step=ckpt.step,
            from_step=last["from_step"],
            skipped_window=last["skipped_window"],
            lr_factor=last["lr_factor"],
        )

    def on_start(self) -> None:
        """At start, before any resume: count the run's rollbacks (all ranks) and find the newest
        known-good checkpoint (rank 0, to protect it from retention). A collective."""
        if self.world.rank == 0:
            kg = self.store.known_good("size")
            self.newest_known_good = kg.step if kg is not None else None
        self.rollbacks = tgdist.broadcast_object(len(read_ledger(self.run_dir)) if self.world.rank == 0 else None)

    def _emit(self, step: int, kind: str, **details: Any) -> None:
        """An event from rank 0 (the decision is the same on every rank), at step number ``step``."""
        if self.world.rank == 0:
            self.events.emit(kind, step, **details)

    # ------------------------------------------------------------------------------------------
    # known-good checkpoints (rank 0)

    def rejoined(self) -> None:
        """This process replaced a lost rank in-process (see :mod:`trainguard.rejoin`); on rank 0,
        rebuild from the store what the lost rank 0 held in memory: the newest known-good checkpoint
        and the committed ones after it still awaiting their verdict (their manifests lack
        ``known_good``). Local: no collective."""
        if self.world.rank != 0:
            return
        kg = self.store.known_good("size")
        self.newest_known_good = kg.step if kg is not None else None
        self.pending = [
            c
            for c in self.store.committed()
            if (kg is None or c.step > kg.step) and "known_good" not in _manifest_or_empty(c)
        ]

    def on_commit(self, ckpt: Checkpoint) -> None:
        """A checkpoint was committed: it awaits its known-good verdict."""
        self.pending.append(ckpt)

    def protected(self) -> set[int]:
        """Steps retention must keep: the newest known-good and the oldest awaiting the verdict."""
        keep = {self.newest_known_good} if self.newest_known_good is not None else set()
        self.pending = [c for c in self.pending if c.path.exists()]
        return keep | ({self.pending[0].step} if self.pending else set())

    def after_step(self, done: int) -> None:
        """At each step boundary (rank 0), ``done`` steps completed: mark the checkpoints whose
        following ``known_good_after`` steps were all healthy."""
        while self.pending and done - self.pending[0].step >= self.cfg.known_good_after:
            c = self.pending[0]
            if self._clean_after(c.step) and c.path.exists():
                try:
                    self.store.mark_known_good(c, done - c.step)
                except OSError as e:  # a full disk: it stays pending, the next step boundary tries again
                    if c.step not in self._unmarked:
                        self._unmarked.add(c.step)
                        console.warn(
                            f"checkpoint at step {c.step} could not be marked known-good yet: {e.strerror or e}"
                        )
                    return
            self.pending.pop(0)
            if self._clean_after(c.step) and c.path.exists():
                self.newest_known_good = c.step
                self._emit(
                    done, "checkpoint_known_good", checkpoint_step=c.step, path=str(c.path), healthy_steps=done - c.step
                )

    def _clean_after(self, step: int) -> bool:
        """Whether the ``known_good_after`` steps after ``step`` had no detection (``False`` when the
        bad steps kept no longer reach back that far)."""
        end = step + self.cfg.known_good_after
        if len(self.bad_steps) == BAD_STEPS_KEPT and self.bad_steps[0] > step:
            return False
        return not any(step < b <= end for b in self.bad_steps)

    def close(self) -> None:
        """Remove the optimizer hooks (this one's and the ramp's). Safe to call twice."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.ramp is not None:
            self.ramp.close()

    # ------------------------------------------------------------------------------------------
    # state saved in checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "ramp": self.ramp.state_dict() if self.ramp else None,
            "consecutive": self.consecutive,
            "skipped": self.skipped,
            "bad_steps": list(self.bad_steps),  # what a replacement of rank 0 needs for the known-good verdicts
        }

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        state = state or {}
        self.detector.load_state_dict(state.get("detector") or {})
        if self.ramp is not None:
            self.ramp.load_state_dict(state.get("ramp") or {})
        self.consecutive = int(state.get("consecutive", 0))
        self.skipped = int(state.get("skipped", 0))
        last_bad = int(state.get("last_bad", 0))  # a checkpoint of an earlier version: the last bad step only
        self.bad_steps = [int(b) for b in state.get("bad_steps", [last_bad] if last_bad else [])]
