"""Zoo shape: a loop that reads its start step before the loop and builds its LR scheduler from it
(the scheduler is not in the checkpoint: it is a function of the step).

Its shape: a DDP MLP and AdamW; the Guard without a scheduler; ``steps = guard.steps(n)``, the
first ``next(steps)`` resumes, then ``start = guard.step`` and a ``LambdaLR`` whose factor is a
warm-up/cosine function of ``start + its own count``; a ``while`` loop that takes the next step at
its end (``next(steps, None)``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

WARMUP = 8


def lr_factor(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2048, 24, generator=g)
    y = torch.sin(x[:, :3].sum(1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(24, 80), torch.nn.GELU(), torch.nn.Linear(80, 1))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    sampler = trainguard.ResumableSampler(len(x), rank, world, seed=cfg.run.seed)
    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt, sampler=sampler)
    steps = guard.steps(STEPS)
    step = next(steps)  # resumes
    start = guard.step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(start + i))
    if rank == 0:
        print(f"starting at step {start}, lr {opt.param_groups[0]['lr']:.2e}", flush=True)
    while step is not None:
        idx = sampler.take(16)
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
        say_step(rank, step + 1, STEPS)
        step = next(steps, None)
    write_weights_hash(model, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
