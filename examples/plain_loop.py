"""The README's "plain loop, guarded" as a whole script, written the way scripts are: it reads ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` before ``init_process_group`` and picks its data shard by them,
broadcasts a seed from rank 0 and waits at a barrier before its loop, calls ``loss.backward()``,
``optimizer.step()`` and ``scheduler.step()`` itself (no ``run_step``, no ``should_step``) and
all-reduces its loss for logging. Every line of trainguard in it is the README's; it gets
in-process recovery as it is (tests/test_any_loop.py, benchmarks/plain_loop_kills.py)::

    trainguard run --nproc-per-node 2 --run-dir runs/plain examples/plain_loop.py   # in-process recovery is on by default

Rank 0 prints ``step N/M loss L``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

RANK = int(os.environ.get("RANK", 0))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))


class WorkerSection(trainguard.Section):
    max_steps: int = Field(300, ge=1)
    hidden: int = Field(256, ge=1)
    batch_size: int = Field(32, ge=1)


class WorkerConfig(trainguard.Config):
    worker: WorkerSection = WorkerSection()


def main() -> None:
    cfg = trainguard.config_from_argv(WorkerConfig)
    w = cfg.worker
    gen = torch.Generator().manual_seed(1234)
    x_all = torch.randn(4096, 16, generator=gen)
    y_all = (x_all @ torch.randn(16, 1, generator=gen)).tanh()
    x, y = x_all[RANK::WORLD_SIZE], y_all[RANK::WORLD_SIZE]  # this rank's shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    seed = torch.tensor([cfg.run.seed * 1000 + 7 if RANK == 0 else 0])
    dist.broadcast(seed, src=0)
    torch.manual_seed(int(seed) + RANK)  # dropout differs per rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, w.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(w.hidden, 1)
    )
    dist.barrier()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.97)
    sampler = trainguard.ResumableSampler(len(x), 0, 1, seed=cfg.run.seed)
    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt, scheduler=sched, sampler=sampler)
    for step in guard.steps(w.max_steps):
        idx = sampler.take(w.batch_size)
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        if RANK == 0:
            print(f"step {step + 1}/{w.max_steps} loss {logged.item() / WORLD_SIZE:.5f}", flush=True)
        guard.step_end(loss=logged)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
