"""The GPT of ``gpt.py`` sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), guarded by trainguard.

Launch (2 CPU ranks, gloo)::

    trainguard run --nproc-per-node 2 --run-dir runs/fsdp2 examples/fsdp2.py --set train.max_steps=150

HSDP (shard inside a group of ranks, replicate across groups): ``--set fsdp.replicas=2`` on 4 ranks
makes a 2-D mesh of 2 replica groups of 2 shards each.

Each transformer block and then the whole model are ``fully_shard``-ed over a 1-D mesh of all
ranks: every rank holds a shard of each parameter and of its optimizer state (DTensors).
trainguard saves them through ``torch.distributed.checkpoint`` (each rank writes its own shard; a
resume on another world size reshards), rolls back in-process, and stops at an agreed step.

What differs from DDP (``gpt.py``):

* **The node-local tier holds shards.** ``[checkpoint.local]`` keeps each rank's tensors as they
  are, here its shard: a restart on the same world size resumes from it (and from a peer's
  replica); a resume on another world size reshards from the persistent tier.
* **No replica check.** ``[sdc] check_interval`` compares replicas of the parameters; sharded
  parameters have none (the check says so and stays off).
* **The gradient norm** is a DTensor: ``clip_grad_norm_`` returns it, ``guard.should_step`` takes it.
* **In-process recovery** (on by default) rolls every rank back to an in-memory snapshot of its
  shard (``[recovery] snapshot_interval``), the lost rank's shard from a peer's copy; with HSDP the
  lost shard comes from its replica in the other group, and nothing is trained again.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, Windows, read_corpus
from pydantic import Field
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainguard


class FSDPSection(trainguard.Section):
    replicas: int = Field(
        1, ge=1, description="HSDP replica groups (1: plain FSDP over all ranks); divides the world size"
    )


class FSDP2Config(GPTConfig):
    """The GPT's sections and ``[fsdp]``."""

    fsdp: FSDPSection = FSDPSection()


def main() -> None:
    cfg = trainguard.config_from_argv(FSDP2Config)
    data = read_corpus(cfg.data)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank, world = trainguard.dist.rank(), trainguard.dist.world_size()
    torch.set_num_threads(cfg.train.threads)
    trainguard.seed_everything(cfg.run.seed)
    train = Windows(data[: int(len(data) * (1 - cfg.data.val_fraction))], cfg.model.seq_len)
    sampler = trainguard.ResumableSampler(len(train), rank, world, seed=cfg.run.seed)

    model = GPT(cfg.model)
    if world % cfg.fsdp.replicas:
        raise trainguard.ConfigError(f"fsdp.replicas = {cfg.fsdp.replicas} does not divide the world size {world}")
    if cfg.fsdp.replicas > 1:  # HSDP: parameters replicated over dimension 0, sharded over dimension 1
        mesh = init_device_mesh(
            "cpu", (cfg.fsdp.replicas, world // cfg.fsdp.replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warm = cfg.train.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warm)))

    guard = trainguard.Guard(cfg, model=model, optimizer=opt, scheduler=sched, sampler=sampler)  # trainguard
    t0 = time.perf_counter()
    for step in guard.steps(cfg.train.max_steps):  # trainguard
        x, y = train.batch(sampler.take(guard.rank_batch(cfg.train.batch_size)))
        opt.zero_grad(set_to_none=True)
        loss = guard.run_step(lambda mb: model(*mb), (x, y))  # trainguard: forward+backward
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.should_step(loss, grad_norm):  # trainguard: NaN/spike check
            opt.step()
            sched.step()
        guard.step_end(loss=loss)  # trainguard
        if rank == 0 and (step + 1) % cfg.train.log_interval == 0:
            ms = (time.perf_counter() - t0) * 1000 / cfg.train.log_interval
            print(f"step {step + 1}/{cfg.train.max_steps} loss {loss.item():.4f} {ms:.0f} ms/step", flush=True)
            t0 = time.perf_counter()
    if rank == 0:
        print(f"state sha256 {guard.state_sha256}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except trainguard.ConfigError as e:
        trainguard.exit_bad_input(str(e))
