"""The README's loop (DDP, ``loss.backward()``, ``should_step(loss)``, ``step_end``; with
``worker.run_step``, ``guard.run_step`` instead of the backward; with ``worker.fsdp2``, the model
``fully_shard``-ed on a 1-D mesh and ``clip_grad_norm_``'s norm given to ``should_step``) counting
the collectives trainguard calls itself from the training thread, run under ``trainguard run``.

It writes ``RUN_DIR/collectives-rank<R>.json``: ``{step: own collectives in that step}`` for every
step it ran. At step ``worker.save_at`` rank 0 creates the save switch (``RUN_DIR/SAVE``): the next
stop check finds it, so the flags that check exchanged are seen to arrive.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.distributed import distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP
from worker_start import start_worker

import trainguard

COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "broadcast_object_list")
own = [0]
WRAPPER = ("collective", "trainguard.rejoin.catch")  # trainguard's pass-through wrapper of dist's collectives


def _trainguards(frame) -> bool:  # noqa: ANN001
    """Whether the collective called from ``frame`` is trainguard's own (not a gradient bucket, which
    trainguard's DDP communication hook, or ``run_step``'s gradient averaging, sends for the loop)."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if (frame.f_code.co_name, name) in (
            ("hook", "trainguard.rejoin.catch"),
            ("_launch", "trainguard.oom.sync"),
            ("clip", "trainguard.instability.clipfold"),  # clip_grad_norm_'s all-reduce, for the loop
        ):
            return False
        if not name.startswith("torch") and name != __name__ and (frame.f_code.co_name, name) != WRAPPER:
            return name.startswith("trainguard")
        frame = frame.f_back
    return False


def _counted(fn):  # noqa: ANN001, ANN202
    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if _trainguards(sys._getframe(1)):
            own[0] += 1
        return fn(*args, **kwargs)

    return counted


class WorkerSection(trainguard.Section):
    max_steps: int = Field(60, ge=1)
    save_at: int = Field(30, ge=1)
    run_step: bool = False
    fsdp2: bool = False


class WorkerConfig(trainguard.Config):
    worker: WorkerSection = WorkerSection()


def main() -> None:
    for name in COUNTED:  # before the Guard wraps them (in-process recovery's catching)
        setattr(c10d, name, _counted(getattr(c10d, name)))
        setattr(dist, name, getattr(c10d, name))
    cfg, rank, world = start_worker(WorkerConfig)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 8, generator=gen), torch.randn(512, 1, generator=gen)
    if cfg.worker.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    else:
        model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt)
    run_dir = Path(cfg.run.dir)
    counts: dict[int, int] = {}
    for step in guard.steps(cfg.worker.max_steps):
        before = own[0]
        idx = torch.arange(8) + 8 * (step % 60)
        opt.zero_grad(set_to_none=True)
        if cfg.worker.run_step:
            loss = guard.run_step(lambda mb: F.mse_loss(model(mb[0]), mb[1]), (x[idx], y[idx]))
        else:
            loss = F.mse_loss(model(x[idx]), y[idx])
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if cfg.worker.fsdp2 else None
        if guard.should_step(loss, norm):
            opt.step()
        guard.step_end(loss=loss)
        counts[step] = own[0] - before
        if step == cfg.worker.save_at and rank == 0:
            (run_dir / cfg.stop.save_switch).touch()
    (run_dir / f"collectives-rank{rank}.json").write_text(json.dumps(counts))
    guard.close()


if __name__ == "__main__":
    main()
