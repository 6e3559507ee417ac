"""Instability detectors: non-finite loss and gradients, loss and gradient-norm spikes.

Per step, every rank writes its loss and gradient norm into its own slots of a ``2 × world size``
vector on the loss's device, zeros elsewhere, without a host synchronization::

    [loss of rank 0, ..., loss of rank n-1, grad norm of rank 0, ..., grad norm of rank n-1]

One ``all_reduce(SUM)`` gathers them (``x + 0 = x``: every rank's values exactly, NaN included,
whatever order the sum takes) and one ``.tolist()`` brings the result to the host (the only
device→host synchronization). From them every rank derives the same verdict: which detectors
fired, the mean loss and gradient norm over the ranks with finite ones, and, when exactly one rank
was non-finite, which one. With a DDP model the losses ride in one of its gradient buckets instead
and the gradient norm is taken on each rank (:mod:`.fold`): no collective of the detectors' own.

Spike rules (:class:`~trainguard.sections.InstabilitySection` documents them and their defaults):
loss ``> mean + factor × max(std, 0.01 × |mean|)``, gradient norm ``> factor × mean``, both over
the last ``window`` values of *applied* steps, checked once ``min_history`` values are known.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from .. import compat
from ..ranks import RankView
from ..sections import InstabilitySection
from .fold import LossFold

DETECTORS = ("nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_spike")
STD_FLOOR = 0.01  # fraction of |mean| below which the standard deviation is not trusted


class RunningStats:
    """Mean and standard deviation of the last ``window`` values (O(1) per value).

    Args:
        window: how many recent values count (≥ 2).
    """

    def __init__(self, window: int):
        self.values: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self._sumsq = 0.0

    def __len__(self) -> int:
        return len(self.values)

    def add(self, x: float) -> None:
        """Append ``x`` (the oldest value leaves once the window is full)."""
        if len(self.values) == self.values.maxlen:
            old = self.values[0]
            self._sum -= old
            self._sumsq -= old * old
        self.values.append(x)
        self._sum += x
        self._sumsq += x * x

    def mean_std(self) -> tuple[float, float]:
        """(mean, population standard deviation); (nan, nan) when empty."""
        n = len(self.values)
        if n == 0:
            return math.nan, math.nan
        mean = self._sum / n
        return mean, math.sqrt(max(self._sumsq / n - mean * mean, 0.0))

    def threshold(self, factor: float) -> float:
        """``mean + factor × max(std, 1 % of |mean|)``: values above it are spikes."""
        mean, std = self.mean_std()
        return mean + factor * max(std, STD_FLOOR * abs(mean))

    def state_dict(self) -> list[float]:
        return list(self.values)

    def load_state_dict(self, values: Iterable[float]) -> None:
        self.values.clear()
        self._sum = self._sumsq = 0.0
        for v in values:
            self.add(float(v))


@dataclass
class Verdict:
    """What the detectors saw in one step (identical on every rank).

    Attributes:
        step: the step number in progress (1-based: ``guard.step + 1``).
        fired: names of the detectors that fired (subset of :data:`DETECTORS`).
        loss: mean loss over the ranks with a finite loss (nan if none).
        grad_norm: mean gradient norm over the ranks with a finite one (nan if none / not given).
        thresholds: spike thresholds in force (``loss``, ``grad_norm``), nan before ``min_history``.
        ranks: ranks with a non-finite loss or gradient when exactly one rank had it, else ``None``
            (several ranks: only their count is known, in ``nonfinite_ranks``).
    """

    step: int
    fired: list[str]
    loss: float
    grad_norm: float
    thresholds: dict[str, float]
    nonfinite_ranks: int = 0
    ranks: Optional[list[int]] = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return not self.fired


def total_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients as a 0-dim tensor, with fused per-device ops and no host sync.

    For sharded gradients (FSDP DTensors) pass the norm from ``clip_grad_norm_`` instead.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = compat.foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


class Detector:
    """Runs all detectors for one step with one collective and one host synchronization.

    Args:
        cfg: the ``[instability]`` section.
        world: this rank and the job size, read at each step (:class:`~trainguard.ranks.RankView`:
            the Guard's shared world, which a shrink changes; world size 1 or no process group: no collective).
    """

    def __init__(self, cfg: InstabilitySection, world: RankView):
        self.cfg, self.world = cfg, world
        self.loss_stats = RunningStats(cfg.window)
        self.grad_stats = RunningStats(cfg.window)

    def observe(self, step: int, loss: Any, grad_norm: Any, fold: Optional[LossFold] = None) -> Verdict:
        """Combine this rank's ``loss`` and ``grad_norm`` (tensors, DTensors or floats; ``grad_norm``
        may be ``None``) with the other ranks' and return the verdict. A collective, unless ``fold``
        (a DDP model's: :mod:`.fold`) carried the losses in one of the step's gradient buckets: call
        on every rank."""
        has_grad = grad_norm is not None
        if hasattr(grad_norm, "full_tensor"):  # a DTensor (FSDP2's clip_grad_norm_): its value, as a plain tensor
            grad_norm = grad_norm.full_tensor()
        n, me = self.world.world_size, self.world.rank
        folded = fold.take(step, loss) if fold is not None and n > 1 else None
        if folded is not None:  # the one host sync; DDP's gradients, so their norm, are alike on every rank
            *values, grad = torch.cat([folded, _scalar(grad_norm, folded.device).reshape(1)]).tolist()
            if fold.usable(values):
                return self._verdict(step, values[fold.layout.slot("loss")], [grad] * n if has_grad else None)
        loss_t = loss.detach().reshape(()).float() if torch.is_tensor(loss) else torch.tensor(float(loss))
        grad_t = _scalar(grad_norm, loss_t.device)
        if n > 1 and dist.is_available() and dist.is_initialized():
            packed = torch.zeros(2 * n, device=loss_t.device)  # rank r's loss and gradient norm in slots r, n + r
            packed[me] = loss_t
            packed[n + me] = grad_t
            dist.all_reduce(packed)  # x + 0 = x: every rank's values exactly, whatever the order of the sum
            values = packed.tolist()  # the one host sync
        else:
            values = torch.stack([loss_t, grad_t]).tolist()
            n = 1
        return self._verdict(step, values[:n], values[n:] if has_grad else None)

    def _verdict(self, step: int, losses: list[float], grads: Optional[list[float]]) -> Verdict:
        """The verdict from every rank's loss and gradient norm (``grads``: ``None`` when not given)."""
        cfg, fired = self.cfg, []
        bad_loss = [r for r, v in enumerate(losses) if not math.isfinite(v)]
        bad_grad = [r for r, v in enumerate(grads) if not math.isfinite(v)] if grads is not None else []
        loss = _mean([v for v in losses if math.isfinite(v)] if bad_loss else losses)
        grad = (_mean([v for v in grads if math.isfinite(v)] if bad_grad else grads)) if grads is not None else math.nan
        if bad_loss:
            fired.append("nonfinite_loss")
        if bad_grad:
            fired.append("nonfinite_grad")
        mean_loss, std_loss = self.loss_stats.mean_std()
        mean_grad = self.grad_stats.mean_std()[0]
        ready = len(self.loss_stats) >= cfg.min_history
        thresholds = {
            "loss": self.loss_stats.threshold(cfg.loss_spike_factor) if ready else math.nan,
            "grad_norm": cfg.grad_spike_factor * mean_grad if ready and len(self.grad_stats) else math.nan,
        }
        if ready and not bad_loss and loss > thresholds["loss"]:
            fired.append("loss_spike")
        if ready and not bad_grad and grad > thresholds["grad_norm"]:
            fired.append("grad_spike")
        alone = sorted({bad[0] for bad in (bad_loss, bad_grad) if len(bad) == 1}) if fired else None
        return Verdict(
            step,
            fired,
            loss,
            grad,
            thresholds,
            max(len(bad_loss), len(bad_grad)),
            alone or None,
            {
                "loss_mean": mean_loss,
                "loss_std": std_loss,
                "grad_norm_mean": mean_grad,
                "history": len(self.loss_stats),
            },
        )

    def record_applied(self, verdict: Verdict) -> None:
        """Add an applied step's values to the running statistics (skipped steps stay out)."""
        if math.isfinite(verdict.loss):
            self.loss_stats.add(verdict.loss)
        if math.isfinite(verdict.grad_norm):
            self.grad_stats.add(verdict.grad_norm)

    def state_dict(self) -> dict[str, list[float]]:
        """The running statistics' values (saved in checkpoints so a resumed run decides alike)."""
        return {"loss": self.loss_stats.state_dict(), "grad_norm": self.grad_stats.state_dict()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.loss_stats.load_state_dict(state.get("loss", []))
        self.grad_stats.load_state_dict(state.get("grad_norm", []))


def _scalar(value: Any, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor on ``device`` of a gradient norm (a tensor, a float, or ``None``: 0)."""
    if torch.is_tensor(value):
        value = value.detach().reshape(())
        return value if value.dtype == torch.float32 and value.device == device else value.to(device, torch.float32)
    return torch.tensor(0.0 if value is None else float(value), device=device)


def _mean(values: list[float]) -> float:
    """The mean of ``values`` (nan if none): the value itself when all are equal (DDP's gradient
    norm, the same on every rank, is then the same whether folded or all-reduced), else their
    exactly rounded sum over their count."""
    if not values:
        return math.nan
    if all(v == values[0] for v in values):
        return values[0]
    return math.fsum(values) / len(values)
