"""Zoo shape: the FSDP2 example (``fully_shard`` per block, then the root; examples/fsdp2.py and
PyTorch's FSDP2 tutorial), written anew at toy size.

Its shape: the process group, a device mesh over the ranks, a model of residual blocks, each block
``fully_shard``-ed and then the whole model, AdamW and a warm-up ``LambdaLR`` built on the sharded
parameters, clipping of the sharded gradients, the data through a ``ResumableSampler``. Guarded as
the FSDP2 example is: forward and backward in ``guard.run_step`` (what in-process recovery of a
sharded model needs), ``should_step`` and ``step_end``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Model(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.inp = nn.Linear(12, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.out = nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.out(h), y)


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(2048, 12, generator=g)
    ys = (xs[:, :4].sum(1, keepdim=True)).tanh()
    sampler = trainguard.ResumableSampler(len(xs), rank, world, seed=cfg.run.seed)
    model = Model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    guard = trainguard.Guard(cfg, model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    for step in guard.steps(STEPS):
        idx = sampler.take(16)
        opt.zero_grad(set_to_none=True)
        loss = guard.run_step(lambda mb: model(*mb), (xs[idx], ys[idx]))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.should_step(loss, grad_norm):
            opt.step()
            sched.step()
        guard.step_end(loss=loss)
        say_step(rank, step + 1, STEPS)
    write_weights_hash(model, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
