"""A small DDP loop whose script fails outside the Guard's steps, as a script bug does (issue 53).

``--before``: every rank raises ``ValueError`` after creating its Guard, before its first step
(after ``init_process_group``, so torch prefixes each line of the traceback with ``[rank<N>]:``).
``--after``: the loop of 6 steps finishes (final checkpoint, ``end`` event), then a final
evaluation: rank 0 raises ``ValueError`` while rank 1 waits for it in an all-reduce (which then
fails on rank 1 as a lost peer's would). ``--die-after-resume``: rank 1 SIGKILLs itself in step 4
of a fresh start and in the first step of every resumed one (a fault that recurs after the
resume, before its first boundary). Settings come from the launcher (``config_from_env``).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


def main() -> None:
    cfg = trainguard.config_from_env()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt)
    if "--before" in sys.argv:
        raise ValueError("a bug before the first step")
    first = None
    for _ in guard.steps(6):
        first = guard.step if first is None else first
        if "--die-after-resume" in sys.argv and dist.get_rank() == 1 and guard.step == (first or 3):
            os.kill(os.getpid(), signal.SIGKILL)
        loss = model(torch.ones(2, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
    score = torch.zeros(1)
    if "--after" in sys.argv and dist.get_rank() == 0:
        raise ValueError("a bug in the final evaluation")
    dist.all_reduce(score)
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
