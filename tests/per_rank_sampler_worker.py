"""A training script whose sampler keeps a per-rank position, run under ``trainguard run`` by
tests/test_elastic.py: its checkpoint cannot be resumed on another world size.

A linear model, DDP over gloo, 10 steps, a checkpoint every 5; the sampler's state is this rank's
own count of batches (it says nothing of ``reshardable``), as many hand-written samplers do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


class PerRankSampler:
    """This rank's batches ``rank, rank + world, ...``: its position is its own count."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.count = rank, world_size, 0

    def next_index(self) -> int:
        self.count += 1
        return self.rank + self.world_size * (self.count - 1)

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


def main() -> None:
    cfg = trainguard.config_from_argv()  # the test passes --set checkpoint.interval=5
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = PerRankSampler(rank, world)
    with trainguard.Guard(cfg, model=model, optimizer=opt, sampler=sampler) as guard:
        for _ in guard.steps(10):
            x = torch.full((2, 4), float(sampler.next_index()))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            guard.step_end()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
