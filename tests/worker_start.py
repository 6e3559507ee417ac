"""Start-up shared by the tests' guarded workers (run as scripts under ``trainguard run``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import trainguard


def start_worker(schema: type[trainguard.Config]) -> tuple[trainguard.Config, int, int]:
    """Parse ``--config``/``--set`` into ``schema``, join the gloo group when launched with several
    ranks, use one CPU thread, seed everything.

    Returns:
        (config, rank, world size).
    """
    cfg = trainguard.config_from_argv(schema)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    return cfg, trainguard.dist.rank(), trainguard.dist.world_size()
