"""A DDP loop for ``[recovery] roll_forward`` (tests/test_roll_forward.py), 2 or more gloo ranks
under ``trainguard run``: a model with batch norm (buffers DDP broadcasts), buckets capped small
(several per backward pass), two backward passes a step (gradient accumulation without
``no_sync``), Adam, and a counter of the loop's own that the Guard is not given: derived from
the first step a launch or a replacement runs (as a resumed script derives it), it moves before
each backward and scales the learning rate, so a survivor that did the interrupted step again
would count it twice.

Usage: ``roll_forward_worker.py [--kill-in-pass N] [--allreduce-before] [--loader] [--set ...]``;
24 steps.
``--kill-in-pass N``: rank 1 SIGKILLs itself in step 9's N-th backward pass, as its first layer's
gradient is computed (its earlier buckets sent, its last not): once per run directory (a marker
file), so its replacement runs on. ``--allreduce-before``: each step all-reduces its batch's size
before the forward (a value the loss is scaled by). ``--loader``: the batches come from a
torchdata ``StatefulDataLoader`` over a ``DistributedSampler``, given to the Guard as its data
position (a loader that keeps its own position: a step done again cannot take it back).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torchdata.stateful_dataloader import StatefulDataLoader

import trainguard

STEPS, KILL_STEP = 24, 9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-in-pass", type=int, default=0)
    parser.add_argument("--allreduce-before", action="store_true")
    parser.add_argument("--loader", action="store_true")
    args, rest = parser.parse_known_args()
    cfg = trainguard.config_from_argv(argv=rest)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.Linear(64, 1),
    )
    model = DDP(net, bucket_cap_mb=0.005)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    marker = Path(cfg.run.dir) / "killed-once"
    state = {"pass": 0, "step": 0}

    def kill_here(grad: torch.Tensor) -> torch.Tensor:
        state["pass"] += 1
        due = state["step"] == KILL_STEP and state["pass"] == args.kill_in_pass
        if rank == 1 and due and not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    net[0].weight.register_hook(kill_here)
    seen = None  # the loop's own counter of micro-batches (not given to the Guard)
    loader, batches = None, None
    if args.loader:
        data = torch.utils.data.TensorDataset(
            torch.randn(2048, 8, generator=torch.Generator().manual_seed(1)),
            torch.randn(2048, 1, generator=torch.Generator().manual_seed(2)),
        )
        sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
        loader = StatefulDataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator())
    with trainguard.Guard(cfg, model=model, optimizer=optimizer, sampler=loader) as guard:
        for step in guard.steps(STEPS):
            state["step"], state["pass"] = step, 0
            if seen is None:  # where this process starts: a fresh start, a resume, a replacement
                seen = 2 * (step - 1)
            optimizer.zero_grad()
            for micro in range(2):
                if loader is not None:  # the iterator made in the loop: after a resume loaded the position
                    batches = batches or iter(loader)
                    x, y = next(batches)
                else:
                    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
                    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
                scale = torch.tensor([float(len(x))])
                if args.allreduce_before:
                    dist.all_reduce(scale)
                seen += 1
                loss = F.mse_loss(model(x), y) * (16.0 / float(scale))
                loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = 1e-2 / (1 + 0.01 * seen)
            if guard.should_step(loss):
                optimizer.step()
            guard.step_end(loss=loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
