"""A training loop in nanoGPT's ``train.py`` order (tests/test_prefetch.py), launched by ``trainguard run``.

``python nanogpt_worker.py MAX_ITERS``: seed, model (with dropout), DDP, optimizer, then the very first
batch fetched with ``torch.randint`` *before* the Guard exists, as upstream nanoGPT fetches it before
its loop; inside each step the forward, then the next micro-batch fetched right away (while the GPU
would be busy), then the backward. Two micro-batches a step. Every rank prints a ``preamble:`` line
first (as nanoGPT dumps its config before it reads ``RANK``); rank 0 prints ``step N/M loss L``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

ACCUM, BATCH, BLOCK = 2, 8, 16


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 32):
        super().__init__()
        self.emb, self.mix, self.out = nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.mix(self.emb(x))))
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


def main() -> None:
    max_iters = int(sys.argv[1])
    print(f"preamble: max_iters={max_iters}, {ACCUM} micro-batches of {BATCH}", flush=True)  # nanoGPT's config dump
    cfg = trainguard.config_from_env()  # (reads the rank's variables: a warm spare waits here for its rank)
    data = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(1337 + rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
        return torch.stack([data[i : i + BLOCK] for i in ix]), torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])

    model = DDP(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = get_batch()  # fetch the very first batch (nanoGPT: before its loop; here before the Guard too)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt)
    for it in guard.steps(max_iters):
        for _ in range(ACCUM):
            loss = model(x, y) / ACCUM
            x, y = get_batch()  # the next micro-batch, fetched while the forward runs on the GPU
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {it + 1}/{max_iters} loss {loss.item() * ACCUM:.4f}", flush=True)
        guard.step_end(loss=loss.detach() * ACCUM)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
