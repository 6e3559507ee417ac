"""A DDP loop that updates its parameters by hand, as classic examples do (no torch optimizer: the
gradients clipped, then ``p.add_(p.grad, alpha=-lr)``), guarded with the model alone; 2 gloo ranks
under ``trainguard run``. Each rank's batch is drawn from a generator seeded by step and rank.

Usage: ``hand_update_worker.py [guarded] [--set ...]``; 30 steps. ``guarded``: the update runs
only ``if guard.should_step(loss)``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

STEPS, LR = 30, 0.05


def main() -> None:
    guarded = sys.argv[1:2] == ["guarded"]
    cfg = trainguard.config_from_argv(argv=sys.argv[1 + guarded :])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    with trainguard.Guard(cfg, model=model) as guard:
        for step in guard.steps(STEPS):
            gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if guarded and not guard.should_step(loss):
                model.zero_grad()
            else:
                update(model)
            guard.step_end(loss=loss)
    dist.destroy_process_group()


def update(model: torch.nn.Module) -> None:
    """The classic hand-written update: ``p.data`` moved against the gradient."""
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)
            p.grad = None


if __name__ == "__main__":
    main()
