"""Zoo shape: the job of issue 43's report: it resumes with ``steps = guard.steps(n); first =
next(steps)``, then runs ``dist.barrier()`` once before its loop.

Its shape: ``RANK``/``WORLD_SIZE`` read before ``init_process_group``, a DDP MLP with dropout,
AdamW, the data through a ``ResumableSampler``; after the first ``next(steps)`` (the resume) a
``dist.barrier()`` ("everyone resumed"), then a plain loop (``loss.backward()``, ``opt.step()``,
``guard.step_end``) over the first step and the rest of the generator.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

RANK = int(os.environ.get("RANK", 0))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2048, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).tanh()
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sampler = trainguard.ResumableSampler(len(x), RANK, WORLD_SIZE, seed=cfg.run.seed)
    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt, sampler=sampler)
    steps = guard.steps(STEPS)
    first = next(steps)
    if RANK == 0:
        print(f"resumed at step {first}", flush=True)
    dist.barrier()
    for step in itertools.chain([first], steps):
        idx = sampler.take(16)
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
        say_step(RANK, step + 1, STEPS)
    write_weights_hash(model, RANK)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
