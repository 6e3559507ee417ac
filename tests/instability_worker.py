"""A tiny guarded regression loop for the instability tests, run under ``trainguard run``.

It writes one JSON line per step and rank to ``RUN_DIR/steps-rank<R>.jsonl``: the step number,
the sample indices of its batch, whether ``should_step()`` let it apply, the state hash (model +
optimizer) before and after, the learning rate the optimizer actually used (seen by a step
pre-hook registered after the Guard's) and the scheduler's rate. A hook can override the policy
(``--set worker.hook_action=rollback``) and records ``on_rollback`` calls.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel as DDP
from worker_start import start_worker

import trainguard


class WorkerSection(trainguard.Section):
    max_steps: int = Field(60, ge=1)
    samples: int = Field(20000, ge=100)
    batch_size: int = Field(4, ge=1)
    lr: float = Field(0.02, gt=0)
    hook_action: Optional[str] = None


class WorkerConfig(trainguard.Config):
    worker: WorkerSection = WorkerSection()


class Recorder(trainguard.Hook):
    def __init__(self, action: Optional[str], path: Path):
        self.action, self.path = action, path

    def on_instability(self, guard, event):
        return self.action

    def on_rollback(self, guard, from_step, to_step):
        with open(self.path, "a") as f:
            f.write(
                json.dumps({"rank": guard.rank, "from_step": from_step, "to_step": to_step, "step_now": guard.step})
                + "\n"
            )


def main() -> None:
    cfg, rank, world = start_worker(WorkerConfig)
    w = cfg.worker
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(w.samples, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(w.samples, 1, generator=gen)
    model = torch.nn.Linear(8, 1)
    net = DDP(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.02 * s))
    sampler = trainguard.ResumableSampler(w.samples, rank, world, seed=cfg.run.seed)
    run_dir = Path(cfg.run.dir)
    hooks = [Recorder(w.hook_action, run_dir / "on_rollback.jsonl")]
    guard = trainguard.Guard(cfg, model=net, optimizer=opt, scheduler=sched, sampler=sampler, hooks=hooks)
    seen: dict[str, float] = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.__setitem__("lr", o.param_groups[0]["lr"]))
    out = open(run_dir / f"steps-rank{rank}.jsonl", "a")
    loss = torch.zeros(())  # a launch that resumes at max_steps runs no step
    for step in guard.steps(w.max_steps):
        idx = sampler.take(w.batch_size)
        before = trainguard.state_hash(net, opt)
        loss = F.mse_loss(net(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        seen.clear()
        sched_lr = sched.get_last_lr()[0]
        applied = guard.should_step(loss)
        if applied:
            opt.step()
            sched.step()
        rec = {
            "step": step + 1,
            "attempt": guard.events.attempt,
            "indices": idx,
            "applied": applied,
            "loss": loss.item(),
            "before": before,
            "after": trainguard.state_hash(net, opt),
            "lr_seen": seen.get("lr"),
            "sched_lr": sched_lr,
            "guard_step": guard.step,
        }
        out.write(json.dumps(rec) + "\n")
        out.flush()
        guard.step_end(loss=loss.detach())
    assert math.isfinite(loss.item())
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except trainguard.ConfigError as e:
        trainguard.exit_bad_input(str(e))
