"""The transparency matrix's worker (issue 51): one process per rank runs every row of
:data:`ROWS` one after the other (each row a fresh model, optimizer and, with ``guard``, a fresh
Guard closed before the next row: several Guards one after the other in one process) and writes
``OUT/hashes-<variant>-rank<R>.json``: ``{row: sha256 of the rank's parameters and optimizer
state after STEPS steps}``, plus ``census`` (tests/patch_census.py) after the last Guard closed.

Usage: ``transparency_worker.py plain|guard OUT VARIANT [ROW ...]`` (no rows: all of them), under
``python -m torch.distributed.run`` or ``trainguard run``, 4 gloo ranks (the sub-group rows need
4). Each row's Guard has its own run directory (``OUT/runs-<variant>/<row>``), so no row resumes
from another's checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from patch_census import replaced
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

STEPS = 5


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a step (each rank its own): 16 x 8 inputs, 16 x 1 targets."""
    gen = torch.Generator().manual_seed(1000 * step + 100 * micro + dist.get_rank())
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


class Unused(torch.nn.Module):
    """A model with a branch no step uses (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = net(), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def plain_step(model: torch.nn.Module) -> Callable[[int], torch.Tensor]:
    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return step


def accumulate(model: DDP, how: str) -> Callable[[int], torch.Tensor]:
    """Two micro-batches a step, the first without the gradient all-reduce."""

    def step(i: int) -> torch.Tensor:
        x, y = batch(i, 0)
        if how == "no_sync":
            with model.no_sync():
                (F.mse_loss(model(x), y) / 2).backward()
        else:
            model.require_backward_grad_sync = False
            (F.mse_loss(model(x), y) / 2).backward()
            model.require_backward_grad_sync = True
        x, y = batch(i, 1)
        loss = F.mse_loss(model(x), y) / 2
        loss.backward()
        return loss

    return step


def clipped(model: torch.nn.Module) -> Callable[[int], torch.Tensor]:
    def step(i: int) -> torch.Tensor:
        loss = plain_step(model)(i)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        return loss

    return step


def autocast_step(model: torch.nn.Module) -> Callable[[int], torch.Tensor]:
    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        return loss

    return step


def sub_groups(size: int) -> Any:
    """This rank's data-parallel group: ranks split in consecutive groups of ``size`` (every rank
    creates every group, as ``new_group`` needs)."""
    world = dist.get_world_size()
    mine = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = g
    return mine


def mesh_2d(names: tuple[str, str]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=names)


def fsdp_row(name: str) -> tuple[torch.nn.Module, Callable[[int], torch.Tensor]]:
    """FSDP2: on a 1-D mesh of every rank with the gradients clipped (``fsdp_clip``), HSDP over
    a 2-D mesh (``hsdp``, clipped too), or sharded on the second dimension of a 2-D mesh only, the
    first used by the script for its own all-reduce of the loss (logging)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, other = net(), None
    if name == "fsdp_clip":
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    elif name == "hsdp":
        fully_shard(model, mesh=mesh_2d(("replicate", "shard")))
    else:
        mesh = mesh_2d(("other", "dp"))
        fully_shard(model, mesh=mesh["dp"])
        other = mesh["other"].get_group()

    def step(i: int) -> torch.Tensor:
        loss = plain_step(model)(i)
        if other is not None:
            logged = loss.detach().clone()
            dist.all_reduce(logged, group=other)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        return loss

    return model, step


def ddp_row(name: str) -> tuple[torch.nn.Module, Callable[[int], torch.Tensor]]:
    if name == "ddp_world":
        model = DDP(net())
    elif name == "ddp_subgroup":
        model = DDP(net(), process_group=sub_groups(2))
    elif name == "find_unused":
        model = DDP(Unused(), find_unused_parameters=True)
    elif name == "static_graph":
        model = DDP(net(), static_graph=True)
    elif name == "bucket_view":
        model = DDP(net(), gradient_as_bucket_view=True)
    elif name == "compiled":
        model = DDP(net())
        compiled = torch.compile(model)
        return model, plain_step(compiled)
    else:
        model = DDP(net())
    if name == "hook_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    if name == "ddp_clip":
        return model, clipped(model)
    if name in ("no_sync", "require_sync"):
        return model, accumulate(model, name)
    if name == "autocast_bf16":
        return model, autocast_step(model)
    return model, plain_step(model)


ROWS = (
    "ddp_world",
    "ddp_subgroup",
    "ddp_clip",
    "fsdp_clip",
    "hsdp",
    "fsdp_2d_script_dim",
    "hook_fp16",
    "powersgd",
    "no_sync",
    "require_sync",
    "find_unused",
    "static_graph",
    "bucket_view",
    "autocast_bf16",
    "compiled",
)


def build(name: str) -> tuple[torch.nn.Module, Callable[[int], torch.Tensor]]:
    if name in ("fsdp_clip", "hsdp", "fsdp_2d_script_dim"):
        return fsdp_row(name)
    return ddp_row(name)


def state_hash(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of this rank's parameters (local shards for FSDP2) and optimizer state, in order."""
    h = hashlib.sha256()

    def put(t: Any) -> None:
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())

    for p in model.parameters():
        put(p)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                put(v)
    return h.hexdigest()


def run_row(name: str, guarded: bool, run_dir: Path) -> str:
    model, step = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if not guarded:
        for i in range(STEPS):
            step(i)
            opt.step()
            opt.zero_grad()
        return state_hash(model, opt)
    cfg = trainguard.config_from_env()
    cfg.run.dir = run_dir
    with trainguard.Guard(cfg, model=model, optimizer=opt) as guard:
        for i in guard.steps(STEPS):
            loss = step(i)
            if guard.should_step(loss):
                opt.step()
            opt.zero_grad()
            guard.step_end(loss=loss)
    return state_hash(model, opt)


def main() -> None:
    mode, out, variant, *rows = sys.argv[1:]
    out = Path(out)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hashes = {}
    for name in rows or ROWS:
        hashes[name] = run_row(name, mode == "guard", out / f"runs-{variant}" / name)
        dist.barrier()
    result = {"hashes": hashes, "census": replaced()}
    (out / f"hashes-{variant}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
