"""An outside job's shape that in-process recovery met badly (issue 43): it reads ``RANK`` before
``init_process_group``, builds DDP and the Guard, resumes with ``steps = guard.steps(n);
first = next(steps)``, runs ``dist.barrier()`` once, then loops with a plain ``loss.backward()``,
``opt.step()`` and ``guard.step_end``. A replacement of a lost rank runs that barrier after it has
joined; the survivors are in their step's DDP all-reduce (tests/test_align.py).

``--misalign``: a replacement (``TRAINGUARD_JOIN`` set) skips the logging all-reduce that every
other rank runs before its backward in the first step after the join, so its collectives can never
line up with the survivors' (the recovery must fail in seconds and the group restart).
``--batchnorm``: the model has a batch norm layer, so DDP's forward starts with a broadcast of its
buffers (``broadcast_buffers``, on by default): the survivors' first collective after the meeting.
``--own-counter``: the loop counts its updates itself (timm's ``num_updates``, from the resumed
step) and sets the learning rate from that count before each ``opt.step()``: a survivor that does
a step again counts it twice (tests/test_loop_check.py).
``--log-by-counter``: the loop counts its updates itself and all-reduces its loss after the update
when that count is even (timm's ``reduce_tensor`` at its log interval, decided by ``batch_idx``): a
survivor that does a step again is one count ahead, and runs that collective in other steps than
its replacement (tests/test_loop_check.py).
``--val-after-end``: every 10 steps, after ``guard.step_end``, the loop all-reduces a validation
loss (the zoo's val_allreduce shape): a survivor that met a replacement at the end of an abandoned
step runs it before doing the step again (tests/test_align.py).
``--eval-draws``: dropout, and after every 10th update an evaluation whose ``DataLoader`` draws
from torch's generator after the step's last gradient bucket; with ``--die-in-eval`` rank 1 of the
first attempt kills itself inside the evaluation of step 50 (tests/test_boundary_confirm.py).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

RANK = int(os.environ.get("RANK", 0))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))
MISALIGN = "--misalign" in sys.argv
BATCHNORM = "--batchnorm" in sys.argv
OWN_COUNTER = "--own-counter" in sys.argv
EVAL_DRAWS = "--eval-draws" in sys.argv  # dropout, and an evaluation DataLoader after every 10th update
LOG_BY_COUNTER = "--log-by-counter" in sys.argv  # after the update, all-reduce the loss when its own count is even
VAL_AFTER_END = "--val-after-end" in sys.argv  # every 10 steps after step_end, all-reduce a validation loss
DIE_IN_EVAL = "--die-in-eval" in sys.argv  # rank 1 of the first attempt SIGKILLs itself in the evaluation of step 50
SEED_PER_RANK = "--seed-per-rank" in sys.argv  # torch's generator seeded 5 + rank (nanoGPT's seed_offset)
FLAGS = (
    "--misalign",
    "--batchnorm",
    "--own-counter",
    "--eval-draws",
    "--die-in-eval",
    "--log-by-counter",
    "--val-after-end",
    "--seed-per-rank",
)


def main() -> None:
    argv = [a for a in sys.argv[1:] if a not in FLAGS]
    cfg = trainguard.config_from_argv(argv=argv)
    max_steps = 120
    gen = torch.Generator().manual_seed(99)
    x_all = torch.randn(2048, 8, generator=gen)
    y_all = (x_all @ torch.randn(8, 1, generator=gen)).sin()
    x, y = x_all[RANK::WORLD_SIZE], y_all[RANK::WORLD_SIZE]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(5 + (RANK if SEED_PER_RANK else 0))
    norm = [torch.nn.BatchNorm1d(64)] if BATCHNORM else []
    drop = [torch.nn.Dropout(0.1)] if EVAL_DRAWS else []
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), *norm, torch.nn.Tanh(), *drop, torch.nn.Linear(64, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sampler = trainguard.ResumableSampler(len(x), 0, 1, seed=cfg.run.seed)
    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt, sampler=sampler)
    steps = guard.steps(max_steps)
    step = next(steps, None)
    dist.barrier()  # once, after resuming: the survivors of a lost rank passed theirs long ago
    joined_at = guard.step if os.environ.get("TRAINGUARD_JOIN") else None
    updates = guard.step  # --own-counter: the loop's own count of updates
    while step is not None:
        idx = sampler.take(16)
        loss = F.mse_loss(ddp(x[idx]), y[idx])
        logged = loss.detach().clone()
        if not (MISALIGN and joined_at is not None and guard.step == joined_at):
            dist.all_reduce(logged)
        loss.backward()
        if OWN_COUNTER or LOG_BY_COUNTER:
            updates += 1
        if OWN_COUNTER:
            for group in opt.param_groups:
                group["lr"] = 0.05 * (1 - updates / (2 * max_steps))
        opt.step()
        opt.zero_grad()
        if LOG_BY_COUNTER and updates % 2 == 0:  # timm's reduce_tensor at its log interval, by batch_idx
            dist.all_reduce(loss.detach().clone())
        if EVAL_DRAWS and (step + 1) % 10 == 0:  # a DataLoader's iterator draws its seed from torch's generator
            with guard.section("eval"):
                sum(len(b) for b in torch.utils.data.DataLoader(range(8), batch_size=4))
                first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                if DIE_IN_EVAL and RANK == 1 and step + 1 == 50 and first_attempt and joined_at is None:
                    os.kill(os.getpid(), signal.SIGKILL)  # after the step's last bucket, before its end
        if RANK == 0:
            print(f"step {step + 1}/{max_steps} loss {logged.item() / WORLD_SIZE:.5f}", flush=True)
        guard.step_end(loss=logged)
        if VAL_AFTER_END and (step + 1) % 10 == 0:  # the hand-written DDP loop's validation, after step_end
            with guard.section("eval"):
                dist.all_reduce(loss.detach().clone())
        step = next(steps, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
