"""A DDP loop with torch's fp16 compression hook (``fp16_compress_hook``), registered before the
Guard, after it, or with no Guard at all (``worker.hook``: ``before``, ``after``, ``plain``), run
on 2 gloo ranks under ``trainguard run`` (``plain``: ``python -m torch.distributed.run``).

Each rank writes ``OUT/weights-<hook>-rank<R>.pt`` (the model's final parameters) and, under a
Guard, ``OUT/census-<hook>-rank<R>.json``: the process-wide objects replaced before the Guard,
while it is open (after its first step) and after its ``close()`` (tests/patch_census.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from patch_census import replaced
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

STEPS = 6


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def main() -> None:
    hook, out = sys.argv[1], Path(sys.argv[2])
    sys.argv = [sys.argv[0], *sys.argv[3:]]  # the --set overrides, for the Guard
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    census = {"before": replaced(model)}
    if hook in ("before", "plain"):
        model.register_comm_hook(None, fp16_compress_hook)
    if hook == "plain":
        for step in range(STEPS):
            x, y = batch(step, rank)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    else:
        guard = trainguard.Guard.from_config(None, model=model, optimizer=opt)
        if hook == "after":
            model.register_comm_hook(None, fp16_compress_hook)
        for step in guard.steps(STEPS):
            x, y = batch(step, rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if guard.should_step(loss):
                opt.step()
            opt.zero_grad()
            guard.step_end(loss=loss)
            census.setdefault("during", replaced(model))
        guard.close()
        census["after"] = replaced(model)
        (out / f"census-{hook}-rank{rank}.json").write_text(json.dumps(census))
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, out / f"weights-{hook}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
