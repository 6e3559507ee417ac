"""A guarded DDP loop whose rank 1 dies without closing its connections (tests/test_nccl_policy.py).

At step ``worker.lose_at`` (once per run directory), rank 1 forks a child that keeps the
rank's sockets open (its gloo connections among them) for ``worker.hold`` seconds and SIGKILLs
itself: its peers' collective does not fail (no connection closes), as an NCCL collective on
one node does not when a peer dies in it. It writes the wall time of its death to
``RUN_DIR/lost_at`` first.

``worker.backend``: ``gloo``, or ``registered``: a backend registered through torch's public
``Backend.register_backend`` under the name ``tg_registered`` whose groups are gloo's (a real
default group whose backend is not gloo, as a third-party backend's would be: the backend policy
treats it as it treats NCCL, declining in-process recovery by default).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

REGISTERED = "tg_registered"


class WorkerSection(trainguard.Section):
    max_steps: int = Field(30, ge=1)
    lose_at: int = Field(0, ge=0, description="step after which rank 1 dies with its connections held open; 0: never")
    hold: float = Field(30.0, gt=0, description="seconds the child holds the dead rank's connections")
    backend: str = Field("gloo")
    step_sleep: float = Field(0.02, ge=0, description="seconds of 'compute' per step")


class WorkerConfig(trainguard.Config):
    worker: WorkerSection = WorkerSection()


def _gloo(store, rank, size, timeout):  # type: ignore[no-untyped-def]
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def die_holding_connections(run_dir: Path, hold: float) -> None:
    """Fork a child that keeps this process's file descriptors (and so its connections) open for
    ``hold`` seconds, note the time, and SIGKILL this process."""
    if os.fork() == 0:
        for fd in (0, 1, 2):  # not the launcher's pipes: only the sockets stay
            os.close(fd)
        time.sleep(hold)
        os._exit(0)
    (run_dir / "lost_at").write_text(f"{time.time():.6f}")
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    cfg = trainguard.config_from_argv(WorkerConfig)
    w = cfg.worker
    if w.backend == "registered":
        dist.Backend.register_backend(REGISTERED, _gloo, devices=["cpu"])
    dist.init_process_group(REGISTERED if w.backend == "registered" else w.backend, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    rank = dist.get_rank()
    lost_at = Path(cfg.run.dir) / "lost_at"  # written once: a replacement or a restarted group goes on
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)
    for step in guard.steps(w.max_steps):
        if rank == 1 and step == w.lose_at and w.lose_at and not lost_at.exists():
            die_holding_connections(Path(cfg.run.dir), w.hold)
        time.sleep(w.step_sleep)
        i = (step * 16) % 256
        loss = F.mse_loss(model(x[i : i + 16]), y[i : i + 16])
        loss.backward()
        if guard.should_step(loss):
            opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1}/{w.max_steps} loss {loss.item():.5f}", flush=True)
        guard.step_end(loss=loss)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
