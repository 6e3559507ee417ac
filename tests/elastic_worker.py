"""A tiny guarded regression loop for the shrink-and-grow test, run under ``trainguard run``.

Each rank trains ``guard.rank_batch(worker.batch_size)`` samples per step from a
:class:`~trainguard.ResumableSampler` and writes one JSON line per step to
``RUN_DIR/steps-pid<PID>.jsonl``: the step, its rank and world size then, the sample indices and
whether ``should_step()`` applied it (a step a lost peer interrupted is not applied and is
done again). With ``worker.hold_until_grow``, rank 0 of a group smaller
than the one the run started with waits before its step's end until the launcher's ``grow_started``
event is in ``RUN_DIR/events.jsonl`` (so the test waits on the spare being ready, not on how fast
the steps are).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel as DDP
from worker_start import start_worker

import trainguard


class WorkerSection(trainguard.Section):
    max_steps: int = Field(60, ge=1)
    samples: int = Field(2000, ge=100)
    batch_size: int = Field(4, ge=1)
    hold_until_grow: bool = False


class WorkerConfig(trainguard.Config):
    worker: WorkerSection = WorkerSection()


def grow_started(run_dir: Path) -> bool:
    path = run_dir / "events.jsonl"
    return path.exists() and '"grow_started"' in path.read_text()


def main() -> None:
    cfg, rank, world = start_worker(WorkerConfig)
    w = cfg.worker
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(w.samples, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)
    model = torch.nn.Linear(8, 1)
    net = DDP(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = trainguard.ResumableSampler(w.samples, rank, world, seed=cfg.run.seed)
    guard = trainguard.Guard(cfg, model=net, optimizer=opt, sampler=sampler)
    run_dir = Path(cfg.run.dir)
    out = open(run_dir / f"steps-pid{os.getpid()}.jsonl", "a")
    for step in guard.steps(w.max_steps):
        idx = sampler.take(guard.rank_batch(w.batch_size))
        opt.zero_grad(set_to_none=True)
        loss = guard.run_step(lambda b: F.mse_loss(net(b[0]), b[1]), (x[idx], y[idx]))
        applied = guard.should_step(loss)
        if applied:
            opt.step()
        rec = {"step": step + 1, "rank": guard.rank, "world_size": guard.world_size, "indices": idx, "applied": applied}
        out.write(json.dumps(rec) + "\n")
        out.flush()
        shrunk = guard.world_size < guard.elastic.base_world_size
        if w.hold_until_grow and shrunk and guard.rank == 0 and applied:
            deadline = time.monotonic() + 120
            while not grow_started(run_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
        guard.step_end(loss=loss.detach())
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except trainguard.ConfigError as e:
        trainguard.exit_bad_input(str(e))
