"""A training script with a command line of its own, in the shape of the popular single-file GPT
trainers: argparse, gradient accumulation, a GradScaler, batches drawn with ``torch.randint``, and
a periodic evaluation on rank 0 alone while the other ranks wait in the next collective.

trainguard's settings come from the launcher, not from this script's arguments::

    trainguard run --nproc-per-node 2 --run-dir runs/own --set checkpoint.interval=20 \\
        examples/own_cli.py --max_iters 200 --eval_interval 50 --eval_seconds 5

The lines marked ``# trainguard`` are all the integration there is. Patterns shown (see the
README's "Use it in your project"):

* ``trainguard.config_from_env()``: the script's ``sys.argv`` is its own business;
* the GradScaler is saved with the run (``extra_state``), and ``should_step`` gets the loss of the
  whole step (the micro-batches' mean), the one the script prints;
* the batch is drawn *inside* the step: ``--prefetch after_step_end`` draws the next one after
  ``step_end()`` instead, and ``--prefetch nanogpt`` draws the first before the loop and each next
  micro-batch right after the forward (as nanoGPT's ``train.py`` does), which the Guard reports
  (``resume_not_bitwise``) because a resume cannot reproduce it; ``--sampling numpy`` draws the
  batch indices with ``np.random`` instead of ``torch.randint``;
* the evaluation runs inside the step on rank 0 only (``--eval_seconds`` of real computation):
  the hang supervisor sees rank 0 silent but busy and rank 1 waiting for it, and reports a
  ``slow_section`` instead of killing a healthy run. ``--eval_section`` puts it inside
  ``guard.section("eval")``, which times it apart from the steps.

``--data PATH`` reads a file of bytes (a missing one fails before the first step: the launcher
shows the error instead of restarting); the default is synthetic text from the seed.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max_iters", type=int, default=100)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval_interval", type=int, default=0, help="evaluate on rank 0 every N steps (0: never)")
    p.add_argument("--eval_seconds", type=float, default=1.0, help="how long one evaluation computes")
    p.add_argument("--prefetch", choices=("inside", "after_step_end", "nanogpt"), default="inside")
    p.add_argument("--sampling", choices=("torch", "numpy"), default="torch", help="what draws the batch indices")
    p.add_argument("--eval_section", action="store_true", help='evaluate inside guard.section("eval")')
    p.add_argument("--data", default=None, help="a file of bytes (default: synthetic, from the seed)")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 32):
        super().__init__()
        self.emb, self.mix, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(x)))
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def main() -> None:
    args = parse_args()
    cfg = trainguard.config_from_env()  # trainguard: settings from `trainguard run --config/--set`
    if args.data is None:
        data = torch.randint(0, 256, (100_000,), generator=torch.Generator().manual_seed(0))
    else:
        data = torch.frombuffer(bytearray(Path(args.data).read_bytes()), dtype=torch.uint8).long()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed + rank)  # each rank draws its own batches
    np.random.seed(args.seed + rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        high = len(data) - args.block_size - 1
        if args.sampling == "numpy":
            ix = torch.from_numpy(np.random.randint(0, high, size=args.batch_size))
        else:
            ix = torch.randint(high, (args.batch_size,))
        x = torch.stack([data[i : i + args.block_size] for i in ix])
        return x, torch.stack([data[i + 1 : i + 1 + args.block_size] for i in ix])

    def evaluate() -> float:  # rank 0 only; its own generator, so training's random numbers stay put
        gen, losses, t0 = torch.Generator().manual_seed(1), [], time.monotonic()
        with torch.no_grad():
            while time.monotonic() - t0 < args.eval_seconds:
                ix = torch.randint(len(data) - args.block_size - 1, (64,), generator=gen)
                x = torch.stack([data[i : i + args.block_size] for i in ix])
                losses.append(model(x, torch.stack([data[i + 1 : i + 1 + args.block_size] for i in ix])).item())
        return sum(losses) / len(losses)

    model = DDP(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # on a GPU with fp16: torch.amp.GradScaler("cuda")
    guard = trainguard.Guard(cfg, model=model, optimizer=opt, extra_state={"scaler": scaler})  # trainguard
    x, y = get_batch() if args.prefetch in ("after_step_end", "nanogpt") else (None, None)
    for it in guard.steps(args.max_iters):  # trainguard
        if args.eval_interval and it > 0 and it % args.eval_interval == 0 and rank == 0:
            with guard.section("eval") if args.eval_section else contextlib.nullcontext():
                print(f"step {it}: eval loss {evaluate():.4f}", flush=True)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(args.accum):
            if args.prefetch == "inside":
                x, y = get_batch()
            loss = model(x, y) / args.accum
            if args.prefetch == "nanogpt":  # the next micro-batch, drawn while the forward runs (nanoGPT)
                x, y = get_batch()
            scaler.scale(loss).backward()
            total += loss.detach()
        scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.should_step(total, grad_norm):  # trainguard: the step's loss (mean over micro-batches)
            scaler.step(opt)
            scaler.update()
        guard.step_end(loss=total)  # trainguard
        if args.prefetch == "after_step_end":
            x, y = get_batch()
        if rank == 0 and (it + 1) % 10 == 0:
            print(f"step {it + 1}/{args.max_iters} loss {float(total):.4f}", flush=True)
    guard.close()  # trainguard
    if rank == 0:
        print(f"done: state sha256 {guard.state_sha256}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
