"""Rolling back in this process: every rank reloads a checkpoint (an instability rollback, a
replica mismatch's), the state a replacement of a lost rank would start from kept again."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from ..checkpoint.store import Checkpoint
from ..events import Hook
from ..instability.recovery import Recovery, Rollback
from ..rejoin.rank import Rejoin
from ..sdc.replicas import ReplicaCheck
from ..sdc.rerun import StepRerun
from .inprocess import InProcess
from .resume import Resume
from .saving import Commits
from .world import World


class Rollbacks:
    """Reloads a checkpoint on every rank (a collective).

    Args:
        world: the shared view (its step becomes the checkpoint's; ``rolled_back`` is set).
        resumer: loads a checkpoint into this process.
        commits: finishes a save in flight first (it would commit a step of the abandoned trajectory).
        recovery: the instability recovery (the rollback's target and what follows it).
        sdc, reruns: the replica check and step re-runs start again at the checkpoint.
        inprocess: a sharded model's snapshots, the step boundary kept again.
        rejoin: whether the step boundary is kept.
        optimizer, sampler: read before a rollback (the learning rate, the data position).
        hooks, owner: ``on_rollback(owner, from_step, to_step)``.
        section: the hang supervisor's named sections.
    """

    def __init__(
        self,
        world: World,
        resumer: Resume,
        commits: Commits,
        recovery: Recovery,
        sdc: ReplicaCheck,
        reruns: StepRerun,
        inprocess: InProcess,
        rejoin: Rejoin,
        optimizer: Optional[torch.optim.Optimizer],
        sampler: Any,
        hooks: list[Hook],
        owner: Any,
        section: Callable[[str], contextlib.AbstractContextManager[None]],
    ):
        self.world, self.resumer, self.commits, self.recovery = world, resumer, commits, recovery
        self.sdc, self.reruns, self.inprocess, self.rejoin = sdc, reruns, inprocess, rejoin
        self.optimizer, self.sampler, self.hooks, self.owner, self.section = optimizer, sampler, hooks, owner, section

    def reload(self, target: Checkpoint, why: str) -> None:
        """Load ``target`` into this process (a collective): every replica holds the same state again."""
        self.world.step = self.resumer.reload(target, why)
        self.sdc.last_good = self.world.step
        self.sdc.forget()
        self.reruns.forget()
        self.inprocess.snapshot(self.world.step, now=True, fresh=True)  # the abandoned steps' snapshots must not serve

    def roll_back(self, rb: Rollback) -> None:
        """Carry out an instability rollback decision: reload the known-good checkpoint in this process."""
        with self.section("rollback"):
            self.commits.wait()  # a save in flight would commit a step of the abandoned trajectory afterwards
            target = self.recovery.rollback_target(rb)
            lr_before = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else None
            position = self.sampler.state_dict() if self.sampler is not None else None  # after the bad step's batch
            self.reload(target, f"rolled back from step {rb.from_step} to {target.step}")
            self.recovery.rolled_back(rb, target, position, lr_before)
            if self.rejoin.keeping:  # the state a replacement of a lost rank starts from: after the data skip
                self.inprocess.keep_boundary(self.world.step)
            self.world.rolled_back = True
        for h in self.hooks:
            h.on_rollback(self.owner, rb.from_step, target.step)
