"""Zoo shape: minGPT-DDP (``pytorch/examples``, ``distributed/minGPT-ddp/mingpt/trainer.py`` and
``main.py``), DataLoader worker processes on the training and the evaluation data, guarded as
docs/loops.md shows for an epoch loop and for worker processes.

Its shape: a ``Trainer`` built from a ``TrainerConfig`` dataclass (``batch_size``,
``data_loader_workers``, ``grad_norm_clip``, ``save_every``, ``snapshot_path``); the model is
moved to the device, then the trainer loads its own snapshot (``torch.load`` of
``{model_state, optimizer_state, finished_epoch}``, "Snapshot not found" on a fresh start), then
wraps the model in DDP. Both loaders are ``DataLoader(..., shuffle=False, num_workers=W,
sampler=DistributedSampler(dataset))``; ``train()`` runs ``for epoch in range(epochs_run,
max_epochs): epoch += 1; _run_epoch(epoch, train_loader); if rank 0 and epoch % save_every == 0:
_save_snapshot(epoch); _run_epoch(epoch, test_loader, train=False)``, where ``_run_epoch`` calls
``sampler.set_epoch(epoch)`` (training only) and ``_run_batch`` per batch: the forward returns
``(logits, loss)``, then ``zero_grad(set_to_none=True)``, ``backward``, ``clip_grad_norm_`` and an
AdamW step over two parameter groups (weight decay on the matrices only, as ``create_optimizer``),
and ``loss.item()``. The GPT is scaled down to an embedding, one causal self-attention block and a
head, with minGPT's dropout; the data is a synthetic character sequence in blocks, as
``CharDataset``'s (``x = chunk[:-1]``, ``y = chunk[1:]``); 2 workers per loader.

Guarded as a new user would after reading docs/loops.md: the training loader is torchdata's
``StatefulDataLoader`` given as ``Guard(sampler=...)`` (its worker processes included), the epoch
counter (``epochs_run``) is an ``extra_state`` value, the loop calls ``guard.begin``,
``guard.step_begin``, ``guard.step_end`` and ``guard.finish``. The trainer's own snapshot (rank 0,
every ``save_every`` epochs) is kept, and loaded at start before the Guard's resume, as the
script does it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import trainguard

VOCAB, BLOCK, EMBD = 24, 16, 32


@dataclass
class TrainerConfig:
    batch_size: int = 8
    data_loader_workers: int = 2
    grad_norm_clip: float = 1.0
    snapshot_path: Optional[str] = None
    save_every: int = 1


@dataclass
class Snapshot:
    model_state: Any
    optimizer_state: dict
    finished_epoch: int


class CharBlocks(Dataset):
    """A character sequence cut into blocks of ``BLOCK + 1``: ``x = chunk[:-1]``, ``y = chunk[1:]``."""

    def __init__(self, text: torch.Tensor):
        self.text = text

    def __len__(self) -> int:
        return len(self.text) - BLOCK

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.text[i : i + BLOCK + 1]
        return chunk[:-1], chunk[1:]


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBD)
        self.pos = nn.Parameter(torch.zeros(1, BLOCK, EMBD))
        self.drop = nn.Dropout(0.1)
        self.ln = nn.LayerNorm(EMBD)
        self.attn = nn.MultiheadAttention(EMBD, 2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(EMBD, VOCAB)
        self.register_buffer("mask", torch.triu(torch.ones(BLOCK, BLOCK, dtype=torch.bool), 1))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        x = self.drop(self.tok(idx) + self.pos[:, : idx.shape[1]])
        h = self.ln(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        logits = self.head(x)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def create_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("pos")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.endswith("pos"))]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


class Epochs:
    """The trainer's ``epochs_run``, as a Guard ``extra_state`` value."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Trainer:
    def __init__(self, cfg, config: TrainerConfig, model, optimizer, train_dataset, test_dataset) -> None:
        self.config = config
        self.global_rank = dist.get_rank()
        self.train_loader = self._prepare_dataloader(train_dataset, stateful=True)
        self.test_loader = self._prepare_dataloader(test_dataset, stateful=False)
        self.epochs_run = Epochs()
        self.model = model
        self.optimizer = optimizer
        self.save_every = config.save_every
        self._load_snapshot()
        self.model = DDP(self.model)
        self.guard = trainguard.Guard(
            cfg,
            model=self.model,
            optimizer=optimizer,
            sampler=self.train_loader,
            extra_state={"epochs_run": self.epochs_run},
        )

    def _prepare_dataloader(self, dataset: Dataset, stateful: bool):
        loader = StatefulDataLoader if stateful else DataLoader
        return loader(
            dataset,
            batch_size=self.config.batch_size,
            pin_memory=False,
            shuffle=False,
            num_workers=self.config.data_loader_workers,
            sampler=DistributedSampler(dataset),
        )

    def _load_snapshot(self) -> None:
        try:
            with open(self.config.snapshot_path, "rb") as f:
                snapshot_data = torch.load(f, map_location="cpu")
        except FileNotFoundError:
            print("Snapshot not found. Training model from scratch", flush=True)
            return
        snapshot = Snapshot(**snapshot_data)
        self.model.load_state_dict(snapshot.model_state)
        self.optimizer.load_state_dict(snapshot.optimizer_state)
        self.epochs_run.value = snapshot.finished_epoch
        print(f"Resuming training from snapshot at Epoch {self.epochs_run.value}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor, train: bool = True) -> float:
        with torch.set_grad_enabled(train):
            _, loss = self.model(source, targets)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
            self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int, dataloader, train: bool = True) -> bool:
        """One epoch; ``False`` when the run's steps ran out in it."""
        if train:
            dataloader.sampler.set_epoch(epoch)
        for source, targets in dataloader:
            if train:
                self.guard.step_begin()
            batch_loss = self._run_batch(source, targets, train)
            if train:
                self.guard.step_end(loss=batch_loss)
                say_step(self.global_rank, self.guard.step, STEPS, batch_loss)
                if self.guard.step >= STEPS:
                    return False
        return True

    def _save_snapshot(self, epoch: int) -> None:
        raw_model = self.model.module if hasattr(self.model, "module") else self.model
        snapshot = Snapshot(raw_model.state_dict(), self.optimizer.state_dict(), epoch)
        torch.save(asdict(snapshot), self.config.snapshot_path)
        print(f"Snapshot saved at epoch {epoch}", flush=True)

    def train(self) -> None:
        self.guard.begin(STEPS)
        while self.guard.step < STEPS:
            epoch = self.epochs_run.value + 1
            if not self._run_epoch(epoch, self.train_loader, train=True):
                break
            self.epochs_run.value = epoch
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            self._run_epoch(epoch, self.test_loader, train=False)
        self.guard.finish()
        self.guard.close()


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    text = torch.randint(0, VOCAB, (800,), generator=torch.Generator().manual_seed(5))
    text[1::3] = (text[0::3][: len(text[1::3])] + 1) % VOCAB  # something to learn
    dataset = CharBlocks(text)
    train_len = int(len(dataset) * 0.9)
    split = torch.Generator().manual_seed(0)
    train_set, test_set = torch.utils.data.random_split(dataset, [train_len, len(dataset) - train_len], split)
    model = TinyGPT()
    optimizer = create_optimizer(model)
    snapshot = os.path.join(cfg.run.dir, "gpt_snapshot.pt")
    trainer = Trainer(cfg, TrainerConfig(snapshot_path=snapshot), model, optimizer, train_set, test_set)
    trainer.train()
    write_weights_hash(trainer.model.module, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
