"""What ``guard.should_step(loss, grad_norm)`` does: detect, decide, skip or roll back.

Per step (see :mod:`.detect`): one collective, one host sync, then on every rank the same
decision. A healthy step returns ``True`` (apply ``optimizer.step()`` and ``scheduler.step()``).
Otherwise the most severe policy among the detectors that fired decides (``warn`` < ``skip`` <
``rollback`` < ``raise``), with three rules on top:

1. non-finite gradients are never applied: ``warn`` becomes ``skip``;
2. after ``max_consecutive`` skipped steps in a row the action becomes ``escalate``;
3. hooks may override (``Hook.on_instability(guard, event) -> action``), rank 0's answer wins;
   a rollback past ``max_rollbacks`` gives up (exit code 76) instead.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import dist as tgdist
from ..atomic import write_atomic
from ..checkpoint import manifest as mf
from ..checkpoint.store import Checkpoint
from ..exitcodes import ExitCode
from .detect import Detector, Verdict, total_grad_norm
from .lr_ramp import LRRamp

if TYPE_CHECKING:
    from ..guard import Guard

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


def checkpoint_id(ckpt: Checkpoint) -> str:
    """``step@created``: tells a checkpoint from a later one saved at the same step."""
    return f"{ckpt.step}@{mf.read_manifest(ckpt.path)['meta'].get('created')}"


class Recovery:
    """Instability detection and recovery for one :class:`~trainguard.guard.Guard` (every rank)."""

    def __init__(self, guard: "Guard"):
        self.g = guard
        self.cfg, self.rb = guard.cfg.instability, guard.cfg.rollback
        self.detector = Detector(self.cfg, guard.rank, guard.world_size)
        self.ramp = LRRamp(guard.optimizer, lambda: guard.step + 1) if guard.optimizer is not None else None
        if guard.optimizer is not None:
            guard.optimizer.register_step_pre_hook(self._refuse_rejected_step)
        self.consecutive = 0  # skipped steps in a row
        self.skipped = 0  # skipped steps in this run's history (saved in checkpoints)
        self.rollbacks = 0  # rollbacks in the whole run (from the ledger)
        self.last_bad = 0  # step number of the last step with a detection
        self.rejected = False  # the current step must not be applied
        self.pending: list[Checkpoint] = []  # rank 0: committed, known-good verdict pending
        self.newest_known_good: Optional[int] = None  # rank 0: protected from retention

    # ------------------------------------------------------------------------------------------
    # the per-step check

    def check(self, loss: Any, grad_norm: Any = None) -> bool:
        """Run the detectors and act; ``True`` when the optimizer and scheduler may step."""
        g = self.g
        step = g.step + 1
        if g.faults.numeric_pending:
            loss, grad_norm = g.faults.numeric(step, loss, grad_norm, g.model)
        if grad_norm is None:
            grad_norm = total_grad_norm(g.model.parameters())
        verdict = self.detector.observe(step, loss, grad_norm)
        self.rejected = False
        if verdict.healthy:
            self.consecutive = 0
            self.detector.record_applied(verdict)
            return True
        self.last_bad = step
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
            self._rollback(verdict)
            return False
        self._give_up(verdict, why or f"policy 'raise' for {', '.join(verdict.fired)}")
        return False  # not reached

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
        return {"step": v.step, "detectors": v.fired, "loss": v.loss, "grad_norm": v.grad_norm,
                "thresholds": v.thresholds, "nonfinite_ranks": v.nonfinite_ranks, "ranks": v.ranks,
                "policies": {d: getattr(self.cfg, d) for d in v.fired}, "action": action, "why": why,
                "consecutive": self.consecutive, "running": v.details}

    def _hook_override(self, event: dict, v: Verdict) -> str:
        action = event["action"]
        for h in self.g.hooks:
            answer = h.on_instability(self.g, dict(event))
            if answer is not None:
                if answer not in SEVERITY:
                    raise ValueError(f"{type(h).__name__}.on_instability returned {answer!r}; expected one of {sorted(SEVERITY)} or None")
                action = answer
        if self.g.hooks:
            action = tgdist.broadcast_object(action)  # hooks may differ by rank: rank 0 decides
        if action == "warn" and "nonfinite_grad" in v.fired:
            action = "skip"
        event.update(action=action, hook_override=action != event["action"])
        self._emit(v.step, "instability", **{k: x for k, x in event.items() if k != "step"})
        return action

    def _reject(self) -> None:
        """Zero the gradients and refuse ``optimizer.step()`` for this step."""
        self.rejected = True
        if self.g.optimizer is not None:
            self.g.optimizer.zero_grad(set_to_none=True)
        self.g.model.zero_grad(set_to_none=True)

    def _refuse_rejected_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.rejected:
            raise SkippedStepError(f"optimizer.step() called in step {self.g.step + 1}, which guard.should_step() "
                                   "rejected (skip or rollback): call it only when should_step() returns True")

    def _give_up(self, v: Verdict, why: str) -> None:
        self._reject()
        self._emit(v.step, "instability_give_up", detectors=v.fired, reason=why, rollbacks=self.rollbacks)
        self.g._exit(ExitCode.GIVE_UP, f"instability: {why}")

    # ------------------------------------------------------------------------------------------
    # rollback

    def _rollback(self, v: Verdict) -> None:
        g, bad = self.g, v.step
        at_most = bad - max(1, self.rb.depth)
        with g.section("rollback"):
            g.ckpt.wait()  # a save in flight would commit a step of the abandoned trajectory afterwards
            target = g.store.known_good(g.cfg.checkpoint.verify, at_most) if g.rank == 0 else None
            target = tgdist.broadcast_object(target)
            if target is None:
                self._give_up(v, f"no known-good checkpoint at or before step {at_most} to roll back to")
            lr_before = g.optimizer.param_groups[0]["lr"] if g.optimizer is not None else None
            position = g.sampler.state_dict() if g.sampler is not None else None  # after the bad step's batch
            g._load_checkpoint(target)
            g.ckpt.discard_local_after(target.step, f"rolled back from step {bad} to {target.step}")
            window = bad - target.step
            skip = max(self.rb.skip_batches, window)
            if g.sampler is not None:
                g.sampler.load_state_dict(position)
                if skip > window:
                    g.sampler.skip_batches(skip - window)
            if self.ramp is not None:
                self.ramp.begin(target.step, self.rb.lr_factor, self.rb.lr_ramp_steps)
            self.rollbacks += 1
            self.consecutive = 0
            positions = tgdist.gather_objects(g.sampler.state_dict() if g.sampler is not None else None)
            lr_after = lr_before
            if g.optimizer is not None:
                lr_after = g.optimizer.param_groups[0]["lr"] * (self.ramp.multiplier(target.step + 1) if self.ramp else 1.0)
            if g.rank == 0:
                newer = [c for c in g.store.committed() if c.step > target.step]
                for c in newer:
                    g.store.set_aside(c, f"rolled back from step {bad} to {target.step}", kind="rolledback")
                aside = [c.step for c in newer]
                self.pending = [c for c in self.pending if c.step <= target.step]
                record = {"time": round(time.time(), 3), "attempt": g.events.attempt, "from_step": bad,
                          "to_step": target.step, "checkpoint": checkpoint_id(target), "detectors": v.fired,
                          "skipped_batches": skip, "skipped_window": [target.step + 1, target.step + skip],
                          "lr_factor": self.rb.lr_factor, "lr_ramp_steps": self.rb.lr_ramp_steps,
                          "sampler_states": positions}
                append_ledger(g.run_dir, record)
                self._emit(bad, "rollback", from_step=bad, to_step=target.step, path=str(target.path), detectors=v.fired,
                         skipped_batches=skip, skipped_window=record["skipped_window"], set_aside=aside,
                         lr_before=lr_before, lr_after=lr_after, lr_factor=self.rb.lr_factor,
                         lr_ramp_steps=self.rb.lr_ramp_steps, rollbacks=self.rollbacks, max_rollbacks=self.cfg.max_rollbacks)
            self.newest_known_good = target.step
            self.last_bad = target.step  # the bad steps belong to the abandoned trajectory
            self._reject()
            g._rolled_back = True
        for h in g.hooks:
            h.on_rollback(g, bad, target.step)

    def on_resume(self, ckpt: Checkpoint) -> None:
        """After the Guard loaded ``ckpt`` at start: count past rollbacks, and if the run had rolled
        back to exactly this checkpoint, apply that rollback's data skip and learning-rate ramp."""
        g = self.g
        records, cid = (read_ledger(g.run_dir), checkpoint_id(ckpt)) if g.rank == 0 else (None, None)
        records, cid = tgdist.broadcast_object((records, cid))
        if g.rank == 0 and "known_good" not in mf.read_manifest(ckpt.path):
            self.pending.append(ckpt)
        last = next((r for r in reversed(records) if r["checkpoint"] == cid), None)
        if last is None:
            return
        if g.sampler is not None and last["sampler_states"][g.rank] is not None:
            g.sampler.load_state_dict(last["sampler_states"][g.rank])
        if self.ramp is not None:
            self.ramp.begin(ckpt.step, last["lr_factor"], last["lr_ramp_steps"])
        self._emit(ckpt.step, "rollback_resumed", to_step=ckpt.step, from_step=last["from_step"],
                 skipped_window=last["skipped_window"], lr_factor=last["lr_factor"])

    def on_start(self) -> None:
        """At start, before any resume: count the run's rollbacks (all ranks) and find the newest
        known-good checkpoint (rank 0, to protect it from retention)."""
        g = self.g
        if g.rank == 0:
            kg = g.store.known_good("size")
            self.newest_known_good = kg.step if kg is not None else None
        self.rollbacks = tgdist.broadcast_object(len(read_ledger(g.run_dir)) if g.rank == 0 else None)

    def _emit(self, step: int, kind: str, **details: Any) -> None:
        """An event from rank 0 (the decision is the same on every rank), at step number ``step``."""
        if self.g.rank == 0:
            self.g.events.emit(kind, step, **details)

    # ------------------------------------------------------------------------------------------
    # known-good checkpoints (rank 0)

    def on_commit(self, ckpt: Checkpoint) -> None:
        """A checkpoint was committed: it awaits its known-good verdict."""
        self.pending.append(ckpt)

    def protected(self) -> set[int]:
        """Steps retention must keep: the newest known-good and the oldest awaiting the verdict."""
        keep = {self.newest_known_good} if self.newest_known_good is not None else set()
        self.pending = [c for c in self.pending if c.path.exists()]
        return keep | ({self.pending[0].step} if self.pending else set())

    def after_step(self) -> None:
        """At each step boundary: mark checkpoints whose following steps were all healthy."""
        if not self.pending:
            return
        done = self.g.step
        while self.pending and done - self.pending[0].step >= self.cfg.known_good_after:
            c = self.pending.pop(0)
            if self.last_bad <= c.step and c.path.exists():
                self.g.store.mark_known_good(c, done - c.step)
                self.newest_known_good = c.step
                self.g._emit0("checkpoint_known_good", checkpoint_step=c.step, path=str(c.path), healthy_steps=done - c.step)

    # ------------------------------------------------------------------------------------------
    # state saved in checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "ramp": self.ramp.state_dict() if self.ramp else None,
                "consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        state = state or {}
        self.detector.load_state_dict(state.get("detector") or {})
        if self.ramp is not None:
            self.ramp.load_state_dict(state.get("ramp") or {})
        self.consecutive = int(state.get("consecutive", 0))
        self.skipped = int(state.get("skipped", 0))
