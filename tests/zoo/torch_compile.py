"""Zoo shape: a ``torch.compile``-d model under DDP (nanoGPT's ``compile=True`` path, PyTorch's
"DDP + torch.compile" recipe), written anew at toy size.

Its shape: the model compiled (inductor, the default backend) before DDP wraps it, AdamW, the
README's guarded loop with ``should_step``; the data through a ``ResumableSampler``. The first
steps of every process (and of a replacement) include the compile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2048, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).sin()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    compiled = torch.compile(model)
    ddp = DDP(compiled)
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-3)
    sampler = trainguard.ResumableSampler(len(x), rank, world, seed=cfg.run.seed)
    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt, sampler=sampler)
    for step in guard.steps(STEPS):
        idx = sampler.take(16)
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        if guard.should_step(loss, grad_norm):
            opt.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
        say_step(rank, step + 1, STEPS)
    write_weights_hash(model, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
