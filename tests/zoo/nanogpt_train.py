"""Zoo shape: nanoGPT's ``train.py`` (karpathy/nanoGPT), written anew at toy size.

Its loop's shape: the rank read from the environment before ``init_process_group``, one seed per
rank (``1337 + rank``), ``get_batch`` drawing random windows with ``torch.randint``, the first batch
fetched before the loop and each next one right after the forward (nanoGPT's prefetch), gradient
accumulation with ``model.require_backward_grad_sync`` set on the last micro-step only, a
``GradScaler`` (disabled on the CPU, its calls kept), the learning rate set by hand from the
iteration number, clipping after ``scaler.unscale_``, and an evaluation on rank 0 only every
``EVAL_INTERVAL`` iterations. Guarded as the README says (``config_from_env``, the scaler in
``extra_state``, ``guard.steps``/``guard.step_end``, the evaluation in ``guard.section``).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

BLOCK, VOCAB, BATCH, ACCUM = 16, 48, 4, 2
EVAL_INTERVAL, EVAL_ITERS = 20, 2
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 5


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 32)
        self.wpe = nn.Embedding(BLOCK, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        logits = self.head(x + self.mlp(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def get_lr(it: int) -> float:
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / max(1, STEPS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def main() -> None:
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        init_process_group(backend="gloo")
        ddp_rank = int(os.environ["RANK"])
        master_process = ddp_rank == 0
        seed_offset = ddp_rank
    else:
        ddp_rank, master_process, seed_offset = 0, True, 0
    cfg = trainguard.config_from_env()
    torch.set_num_threads(1)
    torch.manual_seed(1337 + seed_offset)
    data = torch.randint(0, VOCAB, (20000,), generator=torch.Generator().manual_seed(7))
    train_data, val_data = data[:18000], data[18000:]

    def get_batch(split):
        d = train_data if split == "train" else val_data
        ix = torch.randint(len(d) - BLOCK, (BATCH,))
        x = torch.stack([d[i : i + BLOCK] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + BLOCK] for i in ix])
        return x, y

    torch.manual_seed(1337)  # the same initial weights on every rank, as nanoGPT gets from its seed
    model = TinyGPT()
    torch.manual_seed(1337 + seed_offset)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))
    raw_model = model
    if ddp:
        model = DDP(model)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(EVAL_ITERS)
            for k in range(EVAL_ITERS):
                X, Y = get_batch(split)
                _, loss = raw_model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    guard = trainguard.Guard(cfg, model=model, optimizer=optimizer, extra_state={"scaler": scaler})
    X, Y = get_batch("train")  # fetch the very first batch
    for iter_num in guard.steps(STEPS):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0 and master_process:
            with guard.section("eval"):
                losses = estimate_loss()
            print(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        for micro_step in range(ACCUM):
            if ddp:
                model.require_backward_grad_sync = micro_step == ACCUM - 1
            logits, loss = model(X, Y)
            loss = loss / ACCUM
            X, Y = get_batch("train")  # prefetch the next batch right after the forward, as nanoGPT does
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * ACCUM
        guard.step_end(loss=lossf)
        say_step(ddp_rank, iter_num + 1, STEPS, lossf)
    write_weights_hash(raw_model, ddp_rank)
    if ddp:
        destroy_process_group()


if __name__ == "__main__":
    main()
