"""A DDP loop whose DataLoader has worker processes, forked after ``init_process_group`` (as the
tutorial trainers do): each worker inherits the rank's sockets, so a rank that dies leaves its
group connections open in its workers. Run under ``trainguard run`` on 2 gloo ranks; the Guard
holds the model, the optimizer and the loader's sampler (a :class:`trainguard.ResumableSampler`).

Usage: ``loader_workers_worker.py [--set ...]``; 40 steps of 16 samples, 2 workers per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import trainguard

STEPS = 40


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    sampler = trainguard.ResumableSampler(len(data), dist.get_rank(), dist.get_world_size(), seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, num_workers=2)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with trainguard.Guard(cfg, model=model, optimizer=opt, sampler=sampler) as guard:
        batches = iter(loader)
        for _ in guard.steps(STEPS):
            x, y = next(batches)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if guard.should_step(loss):
                opt.step()
            opt.zero_grad()
            guard.step_end(loss=loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
