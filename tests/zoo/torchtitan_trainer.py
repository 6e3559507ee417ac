"""Zoo shape: torchtitan's train loop (pytorch/torchtitan ``train.py``), written anew at toy size.

Its shape: a ``Trainer`` class that builds the parallelized model (DDP here), the optimizer, a
warm-up/decay ``LambdaLR`` and a stateful data iterator in ``__init__``; ``train()`` runs the steps
and calls ``train_step(batch)`` (forward, loss, backward, ``clip_grad_norm_`` with ``foreach``,
optimizer and scheduler steps, ``zero_grad``); every ``LOG_FREQ`` steps the loss is reduced across
ranks (an average and a max all-reduce) for the metrics line. Guarded as the README says: the
trainer's ``train()`` iterates ``guard.steps``; the data iterator (a ``ResumableSampler``) is the
Guard's sampler.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

LOG_FREQ, WARMUP, BATCH, VOCAB, SEQ = 5, 5, 4, 40, 12


class Transformerish(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.norm = nn.LayerNorm(32)
        self.ff = nn.Sequential(nn.Linear(32, 96), nn.SiLU(), nn.Linear(96, 32))
        self.out = nn.Linear(32, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens)
        h = h + self.ff(self.norm(h))
        return self.out(h)


class TokenData:
    """A stateful text loader: windows of a fixed token stream taken through a ResumableSampler."""

    def __init__(self, rank: int, world: int, seed: int):
        self.tokens = torch.randint(0, VOCAB, (8000,), generator=torch.Generator().manual_seed(3))
        self.sampler = trainguard.ResumableSampler(len(self.tokens) - SEQ - 1, rank, world, seed=seed)

    def __iter__(self):
        return self

    def __next__(self):
        idx = self.sampler.take(BATCH)
        x = torch.stack([self.tokens[i : i + SEQ] for i in idx])
        y = torch.stack([self.tokens[i + 1 : i + 1 + SEQ] for i in idx])
        return x, y


class Trainer:
    def __init__(self, cfg: trainguard.Config):
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        torch.manual_seed(cfg.run.seed)
        self.model = DDP(Transformerish())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-3, weight_decay=0.1, foreach=True)
        decay = STEPS - WARMUP
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: (s + 1) / WARMUP if s < WARMUP else max(0.1, 1 - (s - WARMUP) / decay)
        )
        self.dataloader = TokenData(self.rank, self.world, cfg.run.seed)
        self.guard = trainguard.Guard(
            cfg,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            sampler=self.dataloader.sampler,
        )
        self.step = 0

    def train_step(self, batch) -> torch.Tensor:
        inputs, labels = batch
        pred = self.model(inputs)
        loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def log_metrics(self, loss: torch.Tensor) -> None:
        avg, mx = loss.clone(), loss.clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        if self.rank == 0:
            print(f"metrics step {self.step}: loss avg {avg.item():.4f} max {mx.item():.4f}", flush=True)

    def train(self) -> None:
        data_iterator = iter(self.dataloader)
        for step in self.guard.steps(STEPS):
            self.step = step + 1
            loss = self.train_step(next(data_iterator))
            if self.step == 1 or self.step % LOG_FREQ == 0:
                self.log_metrics(loss)
            self.guard.step_end(loss=loss)
            say_step(self.rank, self.step, STEPS, loss.item())

    def close(self) -> None:
        write_weights_hash(self.model.module, self.rank)
        self.guard.close()
        dist.destroy_process_group()


def main() -> None:
    cfg = trainguard.config_from_env()
    trainer = Trainer(cfg)
    trainer.train()
    trainer.close()


if __name__ == "__main__":
    main()
