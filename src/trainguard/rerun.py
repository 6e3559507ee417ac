"""Re-run an unstable step from its inputs, to tell a transient hardware fault from the data.

A step whose loss or gradients are non-finite or spike (the ``[instability]`` detectors of
``guard.should_step()``) is either the data's doing (a bad batch, a diverging model) or a fault of
the hardware that computed it. With ``[sdc] on_instability = "rerun"`` the Guard runs the step once
more before any instability policy acts:

* every rank restores its own state at the step's start: data position and RNG streams, kept in
  memory at each step boundary (the same record as in-process recovery's,
  :class:`~trainguard.rejoin.boundary.BoundaryState`), drops the gradients, and ``guard.steps()``
  yields the same step again, so the loop fetches the same batch and draws the same random
  numbers; parameters and optimizer state are still the step's start (``should_step`` runs
  before ``optimizer.step()``);
* each rank's **result** of the step is an exact fingerprint (:func:`trainguard.sdc.fingerprint`)
  of its own loss and of its gradients after the all-reduce, for the first run and the re-run.

The verdict (:meth:`StepRerun.classify`, the same on every rank):

* **data**: the re-run gave every rank the same result, bit for bit: the computation is
  reproducible, so its inputs are to blame (the data or the model). The ``[instability]`` policy
  acts on the step as it would have without the re-run.
* **transient**: some result changed: a fault in a computation (a flipped bit in an activation, a
  gradient, the reduction), not in stored state. The ranks whose own loss changed are named (none
  when only the gradients changed: the fault was in a backward or the reduction, which every
  rank's gradients share). The re-run's result stands: a healthy re-run is applied; an unhealthy
  one meets the instability policy.

A fault that repeats the same wrong result on the same rank looks like data to a re-run on that
rank (telling them apart needs the rank's batch computed on another rank: not done). Corrupted
*stored* state (parameters) is what the replica fingerprints find (:mod:`trainguard.sdc`).

Cost: nothing per step beyond keeping the boundary state (RNG streams and data position: the
``rerun_keep`` row of ``benchmarks/sdc_overhead.py``); one step and two gradient reads per
re-run (its ``rerun`` row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import dist as tgdist
from .sdc import fingerprint

_UNSET = -(1 << 63)


def step_result(loss: Any, model: torch.nn.Module) -> tuple[int, int]:
    """This rank's result of a step: exact fingerprints of its loss (a tensor or float) and of
    its parameters' gradients (after the all-reduce, as ``should_step`` sees them)."""
    loss_t = loss.detach() if torch.is_tensor(loss) else torch.tensor(float(loss), dtype=torch.float64)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return fingerprint([loss_t.reshape(1)]), fingerprint(grads)


@dataclass(frozen=True)
class RerunVerdict:
    """The verdict of a step re-run (identical on every rank).

    Attributes:
        step: the step number (1-based) that was re-run.
        verdict: ``"data"`` (the same result again) or ``"transient"`` (a changed result).
        ranks: the ranks whose own loss changed (``transient`` only; may be empty).
        first, again: every rank's ``(loss, gradients)`` fingerprints of the first run and the
            re-run, by rank.
    """

    step: int
    verdict: str
    ranks: list[int]
    first: list[list[int]]
    again: list[list[int]]


class StepRerun:
    """Which step is being re-run, and its verdict (see the module doc). One per rank.

    Args:
        enabled: ``[sdc] on_instability == "rerun"``.
        rank, world_size: this rank and the group size.
    """

    def __init__(self, enabled: bool, rank: int, world_size: int):
        self.enabled, self.rank, self.world_size = enabled, rank, world_size
        self.step: Optional[int] = None  # the step number being re-run
        self.first: tuple[int, int] = (0, 0)  # this rank's result of its first run

    def wants(self, step: int) -> bool:
        """Whether an unstable step number ``step`` is re-run now (a step is re-run once)."""
        return self.enabled and self.step != step

    def begin(self, step: int, result: tuple[int, int]) -> None:
        """The first run of step number ``step`` gave ``result``; the caller re-runs the step."""
        self.step, self.first = step, result

    def pending(self, step: int) -> bool:
        """Whether this run of step number ``step`` is the re-run (call :meth:`classify`)."""
        return self.step == step

    def forget(self) -> None:
        """Drop a re-run in progress (the step is abandoned: a rollback, a lost peer)."""
        self.step = None

    def classify(self, result: tuple[int, int]) -> RerunVerdict:
        """Compare the re-run's ``result`` with the first run's on every rank (one all-reduce of
        ``4 × world_size`` integers) and return the verdict.

        Raises:
            RuntimeError: no re-run is pending.
        """
        if self.step is None:
            raise RuntimeError("StepRerun.classify() without a re-run in progress")
        slots = [_UNSET] * (4 * self.world_size)
        slots[4 * self.rank : 4 * self.rank + 4] = [*self.first, *result]
        values = [int(v) for v in tgdist.all_reduce_max(slots)]
        first = [values[4 * r : 4 * r + 2] for r in range(self.world_size)]
        again = [values[4 * r + 2 : 4 * r + 4] for r in range(self.world_size)]
        step, self.step = self.step, None
        if first == again:
            return RerunVerdict(step, "data", [], first, again)
        ranks = [r for r in range(self.world_size) if first[r][0] != again[r][0]]
        return RerunVerdict(step, "transient", ranks, first, again)
