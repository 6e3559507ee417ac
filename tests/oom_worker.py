"""A tiny guarded DDP regression for the OOM and memory-watchdog tests, run under ``trainguard run``.

Each step runs ``guard.run_step`` over a batch of ``worker.batch_size`` samples through a wide
hidden layer (``worker.hidden`` units: the activations of a micro-batch take
``micro-batch × hidden × 4`` bytes, several times over in backward). It writes one JSON line per
step and rank to ``RUN_DIR/steps-rank<R>.jsonl`` (step, micro-batch size after the step, loss).
``worker.plain = true`` runs DDP's own ``loss.backward()`` instead (the reference).

* ``worker.grads_at = K``: after ``run_step`` of step K each rank saves its (all-reduced)
  gradients to ``RUN_DIR/grads-rank<R>.pt``.
* ``worker.limit_mb = M`` with ``worker.limit_rank = R`` and ``worker.limit_step = K``: before
  step K, rank R caps its address space (RLIMIT_AS) at its current size + M MiB, so a batch whose
  activations need more fails in the real CPU allocator.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Optional

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel as DDP
from worker_start import start_worker

import trainguard


class WorkerSection(trainguard.Section):
    max_steps: int = Field(30, ge=1)
    samples: int = Field(4096, ge=16)
    batch_size: int = Field(8, ge=1)
    hidden: int = Field(64, ge=1)
    lr: float = Field(0.01, gt=0)
    grads_at: Optional[int] = None
    plain: bool = False  # DDP's own backward instead of guard.run_step (the reference)
    limit_mb: Optional[int] = None
    limit_rank: int = 1
    limit_step: int = 3


class WorkerConfig(trainguard.Config):
    worker: WorkerSection = WorkerSection()


def main() -> None:
    cfg, rank, world = start_worker(WorkerConfig)
    w = cfg.worker
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(w.samples, 8, generator=gen)
    y = (x**2).sum(1, keepdim=True) + 0.1 * torch.randn(w.samples, 1, generator=gen)
    model = torch.nn.Sequential(torch.nn.Linear(8, w.hidden), torch.nn.Tanh(), torch.nn.Linear(w.hidden, 1))
    net = DDP(model) if world > 1 else model
    opt = torch.optim.Adam(model.parameters(), lr=w.lr)
    sampler = trainguard.ResumableSampler(w.samples, rank, world, seed=cfg.run.seed)
    run_dir = Path(cfg.run.dir)
    guard = trainguard.Guard(cfg, model=net, optimizer=opt, sampler=sampler)
    out = open(run_dir / f"steps-rank{rank}.jsonl", "a")

    def step_fn(micro_batch):
        xb, yb = micro_batch
        return F.mse_loss(net(xb), yb)

    for step in guard.steps(w.max_steps):
        if w.limit_mb is not None and rank == w.limit_rank and step + 1 == w.limit_step:
            cap = psutil.Process().memory_info().vms + w.limit_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
        idx = sampler.take(w.batch_size)
        if w.plain:
            loss = step_fn((x[idx], y[idx]))
            loss.backward()
        else:
            loss = guard.run_step(step_fn, (x[idx], y[idx]))
        if w.grads_at == step + 1:
            torch.save([p.grad.clone() for p in model.parameters()], run_dir / f"grads-rank{rank}.pt")
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": step + 1, "attempt": guard.events.attempt, "micro_batch": guard.micro.size, "loss": loss.item()}
        out.write(json.dumps(rec) + "\n")
        out.flush()
        guard.step_end(loss=loss.detach())
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except trainguard.ConfigError as e:
        trainguard.exit_bad_input(str(e))
