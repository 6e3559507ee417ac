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
* each rank's **result** of the step is an exact fingerprint (:func:`trainguard.sdc.replicas.fingerprint`)
  of its own loss and of its gradients after the all-reduce, for the first run and the re-run.

The verdict (:meth:`StepRerun.classify` and, for one suspect rank, :mod:`trainguard.sdc.crosscheck`;
the same on every rank):

* **transient**: some result changed: a fault in a computation (a flipped bit in an activation, a
  gradient, the reduction), not in stored state. The ranks whose own loss changed are named (none
  when only the gradients changed: the fault was in a backward or the reduction, which every
  rank's gradients share). The re-run's result stands: a healthy re-run is applied; an unhealthy
  one meets the instability policy.
* the same result on every rank, bit for bit: the computation is reproducible. If one rank's loss
  alone is wrong (non-finite, or more than :data:`SUSPECT_FACTOR` times the median of the ranks'
  absolute losses) its partner computes that rank's forward on the same inputs
  (:func:`~trainguard.sdc.crosscheck.cross_check`): a different output makes it **persistent**, that
  rank's hardware (``[sdc] on_persistent`` acts: exclude, replace or raise); otherwise, and when
  every rank is alike, **data** (or the model): the ``[instability]`` policy acts on the step as
  it would have without the re-run.

Cost: nothing per step beyond keeping the boundary state (RNG streams and data position) and the
references to the step's forward inputs (``benchmarks/sdc_overhead.py``); one step and two
gradient reads per re-run, and one forward on two ranks per cross-check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import dist as tgdist
from ..ranks import RankView
from .replicas import fingerprint

# a rank whose loss is this many times the median of the ranks' absolute losses (or non-finite)
# is the suspect of a reproducible instability; a spike of a whole batch moves the median with it
SUSPECT_FACTOR = 100.0


def step_result(loss: Any, model: torch.nn.Module) -> tuple[int, int]:
    """This rank's result of a step: exact fingerprints of its loss (a tensor or float) and of
    its parameters' gradients (after the all-reduce, as ``should_step`` sees them)."""
    loss_t = loss.detach() if torch.is_tensor(loss) else torch.tensor(float(loss), dtype=torch.float64)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return fingerprint([loss_t.reshape(1)]), fingerprint(grads)


def suspect_of(losses: list[float]) -> Optional[int]:
    """The one rank whose loss is wrong while the others' are not (non-finite, or more than
    :data:`SUSPECT_FACTOR` × the median of the finite absolute losses), else ``None``."""
    finite = sorted(abs(x) for x in losses if math.isfinite(x))
    median = finite[(len(finite) - 1) // 2] if finite else math.nan  # the lower median: 2 ranks, the smaller
    odd = [r for r, x in enumerate(losses) if not math.isfinite(x) or abs(x) > SUSPECT_FACTOR * median > 0]
    return odd[0] if len(odd) == 1 and len(losses) > 1 else None


@dataclass(frozen=True)
class RerunVerdict:
    """The verdict of a step re-run (identical on every rank).

    Attributes:
        step: the step number (1-based) that was re-run.
        verdict: ``"data"`` (the same result again), ``"transient"`` (a changed result) or, after
            a cross-check, ``"persistent"``.
        ranks: the ranks whose own loss changed (``transient``), the faulty rank (``persistent``).
        first, again: every rank's ``(loss, gradients)`` fingerprints of the first run and the
            re-run, by rank.
        losses: every rank's loss in the re-run.
        suspect: with ``data``, the one rank whose loss alone is wrong (see :func:`suspect_of`),
            for a cross-check; else ``None``.
        cross_check: the suspect's and its partner's fingerprints of the suspect's forward.
    """

    step: int
    verdict: str
    ranks: list[int]
    first: list[list[int]]
    again: list[list[int]]
    losses: list[float]
    suspect: Optional[int] = None
    cross_check: Optional[list[int]] = None


class StepRerun:
    """Which step is being re-run, and its verdict (see the module doc). One per rank.

    Args:
        enabled: ``[sdc] on_instability == "rerun"``.
        world: this rank and the group size, read at each use (:class:`~trainguard.ranks.RankView`:
            the Guard's shared world, which a shrink changes).
    """

    def __init__(self, enabled: bool, world: RankView):
        self.enabled, self.world = enabled, world
        self.step: Optional[int] = None  # the step number being re-run
        self.first: tuple[int, int] = (0, 0)  # this rank's result of its first run

    def wants(self, step: int) -> bool:
        """Whether an unstable step number ``step`` is re-run now (a step is re-run once)."""
        return self.enabled and self.step != step

    def start(self, step: int, result: tuple[int, int]) -> None:
        """The first run of step number ``step`` gave ``result``; the caller re-runs the step."""
        self.step, self.first = step, result

    def pending(self, step: int) -> bool:
        """Whether this run of step number ``step`` is the re-run (call :meth:`classify`)."""
        return self.step == step

    def forget(self) -> None:
        """Drop a re-run in progress (the step is abandoned: a rollback, a lost peer)."""
        self.step = None

    def classify(self, result: tuple[int, int], loss: float) -> RerunVerdict:
        """Compare the re-run's ``result`` with the first run's on every rank (one all-gather of
        each rank's fingerprints and ``loss``) and return the verdict.

        Raises:
            RuntimeError: no re-run is pending.
        """
        if self.step is None:
            raise RuntimeError("StepRerun.classify() without a re-run in progress")
        every = tgdist.gather_objects((list(self.first), list(result), float(loss)))
        first, again, losses = [e[0] for e in every], [e[1] for e in every], [e[2] for e in every]
        step, self.step = self.step, None
        if first == again:
            return RerunVerdict(step, "data", [], first, again, losses, suspect_of(losses))
        ranks = [r for r in range(self.world.world_size) if first[r][0] != again[r][0]]
        return RerunVerdict(step, "transient", ranks, first, again, losses)
