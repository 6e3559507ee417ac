"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

from trainguard.events import read_events


def trainguard_cmd() -> list[str]:
    """The ``trainguard`` command of this interpreter's environment."""
    exe = Path(sys.executable).parent / "trainguard"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "trainguard.cli"]


def run_events(run_dir: Path) -> list[dict]:
    """All events of a run directory (malformed lines skipped)."""
    return list(read_events(run_dir))


def exited(pid: int) -> bool:
    """True once ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def ddp_mlp(rank: int, world: int, tmp: str, hidden: int, batch: int, lr: float):
    """The benchmarks' training job: one CPU thread, a gloo group (file rendezvous in ``tmp``), a
    4-layer MLP of width ``hidden`` under DDP with AdamW, and a fixed batch of ``batch`` samples.

    Returns:
        (model, ddp, optimizer, x [batch, 256], y [batch]).
    """
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    torch.manual_seed(0)
    h = hidden
    model = nn.Sequential(nn.Linear(256, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model, DDP(model), opt, x, y
