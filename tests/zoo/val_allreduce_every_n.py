"""Zoo shape: a loop that all-reduces its validation loss every N steps (the common hand-written
DDP loop: evaluate after the step, average the loss over the ranks, print it on rank 0).

Its shape: a DDP MLP, AdamW and a ``StepLR``, the README's guarded step (``should_step`` included);
after ``guard.step_end``, every ``VAL_EVERY`` steps each rank evaluates its shard of a held-out set
under ``torch.no_grad()`` and ``dist.all_reduce``-s the loss, in ``guard.section("eval")``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

VAL_EVERY = 10


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2304, 20, generator=g)
    y = (x[:, :5] ** 2).sum(1, keepdim=True).sqrt()
    x_train, y_train, x_val, y_val = x[:2048], y[:2048], x[2048 + rank :: world], y[2048 + rank :: world]
    model = torch.nn.Sequential(torch.nn.Linear(20, 96), torch.nn.Tanh(), torch.nn.Linear(96, 1))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)
    sampler = trainguard.ResumableSampler(len(x_train), rank, world, seed=cfg.run.seed)
    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt, scheduler=sched, sampler=sampler)
    for step in guard.steps(STEPS):
        idx = sampler.take(16)
        loss = F.mse_loss(ddp(x_train[idx]), y_train[idx])
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        if guard.should_step(loss, grad_norm):
            opt.step()
            sched.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
        say_step(rank, step + 1, STEPS)
        if (step + 1) % VAL_EVERY == 0:
            with guard.section("eval"), torch.no_grad():
                val = F.mse_loss(model(x_val), y_val).reshape(1)
                dist.all_reduce(val)
            if rank == 0:
                print(f"val loss at {step + 1}: {val.item() / world:.5f}", flush=True)
    write_weights_hash(model, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
