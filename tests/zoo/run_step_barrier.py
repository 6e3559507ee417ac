"""Zoo shape: the job of issue 55's report: the loop of ``resume_then_barrier.py`` (issue 43's job:
``first = next(steps)``, then ``dist.barrier()`` once before its loop) with its step through
``guard.run_step`` and its update under ``guard.should_step``, as docs/guard.md shows them.

``run_step`` all-reduces the gradients itself (``oom/sync.py``), not through DDP's hook. Before the
fix, the survivors' first collective after a meeting was that all-reduce, which named no site: a
replacement waiting at its script's ``dist.barrier`` heard of no survivor's collective for 3 s,
gave the recovery up, and the group restarted (7.6 s from the kill where a restart takes 3.8 s).
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
        opt.zero_grad(set_to_none=True)
        loss = guard.run_step(lambda b: F.mse_loss(ddp(b[0]), b[1]), (x[idx], y[idx]))
        if guard.should_step(loss):
            opt.step()
        guard.step_end(loss=loss)
        say_step(RANK, step + 1, STEPS)
    write_weights_hash(model, RANK)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
