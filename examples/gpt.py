"""The main job: a small byte-level GPT trained with DDP on real text, guarded by trainguard.

Launch (2 CPU ranks, gloo)::

    trainguard run --nproc-per-node 2 --run-dir runs/gpt examples/gpt.py --set train.max_steps=150

Data: by default the ``.py`` files of the running interpreter's standard library (present on every
machine), or any file or directory given by ``--set data.path=...``. The last ``data.val_fraction``
of the bytes is held out for validation loss.

The training loop below is plain PyTorch; the trainguard lines are marked ``# trainguard``.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


class ModelSection(trainguard.Section):
    """``[model]``: transformer size (defaults: ~3.3 M parameters)."""

    d_model: int = Field(256, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=8)
    dropout: float = Field(0.1, ge=0, lt=1)


class DataSection(trainguard.Section):
    """``[data]``: the text to train on."""

    path: Optional[str] = Field(
        None, description="file or directory of text; default: the Python standard library sources"
    )
    max_bytes: int = Field(8_000_000, ge=10_000, description="read at most this many bytes")
    val_fraction: float = Field(0.05, gt=0, lt=0.5)


class TrainSection(trainguard.Section):
    """``[train]``: optimization."""

    max_steps: int = Field(150, ge=1)
    batch_size: int = Field(
        8, ge=1, description="sequences per rank per step, on the world size the run started with ([elastic] keep)"
    )
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    log_interval: int = Field(10, ge=1)
    eval_batches: int = Field(8, ge=1)
    threads: int = Field(1, ge=1, description="torch CPU threads per rank")


class GPTConfig(trainguard.Config):
    """trainguard's sections plus this script's own."""

    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()


# ---------------------------------------------------------------------------------------------
# data


def _files(root: Path, pattern: str) -> list[Path]:
    """Files under ``root`` matching ``pattern``, not descending into ``site-packages`` (installed
    packages are not the corpus, and walking them took seconds of every rank's start)."""
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [Path(top, n) for n in names if fnmatch.fnmatch(n, pattern) and Path(top, n).is_file()]
    return found


def read_corpus(cfg: DataSection) -> torch.Tensor:
    """All bytes of the corpus (sorted file order, so every rank and every run reads the same), uint8 [N]."""
    root = Path(cfg.path) if cfg.path else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise trainguard.ConfigError(f"data.path {root} does not exist")
    files = [root] if root.is_file() else sorted(_files(root, "*.py" if not cfg.path else "*"))
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= cfg.max_bytes:
            break
    corpus = b"".join(chunks)[: cfg.max_bytes]
    if len(corpus) < 10_000:
        raise trainguard.ConfigError(f"data.path {root} holds only {len(corpus)} bytes; need at least 10000")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


class Windows:
    """Non-overlapping (input, target) windows of ``seq_len`` bytes: sample i starts at i*(seq_len+1)."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // (self.seq_len + 1)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self.data[i * (self.seq_len + 1) : (i + 1) * (self.seq_len + 1)] for i in indices]).long()
        return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------------------------
# model


class Block(nn.Module):
    def __init__(self, cfg: ModelSection):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer over bytes (vocabulary 256), weights of the output layer tied to the embedding."""

    def __init__(self, cfg: ModelSection):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise trainguard.ConfigError(
                f"model.d_model={cfg.d_model} must be a multiple of model.n_heads={cfg.n_heads}"
            )
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        for m in self.modules():  # GPT-2 initialisation: N(0, 0.02), zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.T
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


@torch.no_grad()
def validation_loss(model: nn.Module, val: Windows, cfg: TrainSection) -> float:
    """Mean loss over the first ``eval_batches`` batches of the held-out split (same on every rank)."""
    model.eval()
    n = min(len(val), cfg.eval_batches * cfg.batch_size)
    losses = [model(*val.batch(list(range(i, min(i + cfg.batch_size, n))))).item() for i in range(0, n, cfg.batch_size)]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    cfg = trainguard.config_from_argv(GPTConfig)
    data = read_corpus(cfg.data)  # before joining the group: a warm spare has it read in advance
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank, world = trainguard.dist.rank(), trainguard.dist.world_size()
    torch.set_num_threads(cfg.train.threads)
    trainguard.seed_everything(cfg.run.seed)

    split = int(len(data) * (1 - cfg.data.val_fraction))
    train, val = Windows(data[:split], cfg.model.seq_len), Windows(data[split:], cfg.model.seq_len)
    sampler = trainguard.ResumableSampler(len(train), rank, world, seed=cfg.run.seed)

    model = GPT(cfg.model)
    ddp = DDP(model) if world > 1 else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.train.lr,
        betas=(0.9, 0.95),
    )
    warm, total = cfg.train.warmup_steps, cfg.train.max_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warm
            if s < warm
            else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))
        ),
    )

    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt, scheduler=sched, sampler=sampler)  # trainguard
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"gpt: {n_params / 1e6:.2f} M parameters, {len(data) / 1e6:.1f} MB of text, {world} rank(s)", flush=True)
    t0 = time.perf_counter()
    for step in guard.steps(cfg.train.max_steps):  # trainguard
        x, y = train.batch(sampler.take(guard.rank_batch(cfg.train.batch_size)))  # trainguard: [elastic] keep
        opt.zero_grad(set_to_none=True)
        loss = guard.run_step(
            lambda mb: ddp(*mb), (x, y)
        )  # trainguard: forward+backward; on OOM, halve the micro-batch
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.should_step(loss, grad_norm):  # trainguard: NaN/spike check; skip or roll back
            opt.step()
            sched.step()
        guard.step_end(loss=loss)  # trainguard
        if rank == 0 and (step + 1) % cfg.train.log_interval == 0:
            ms = (time.perf_counter() - t0) * 1000 / cfg.train.log_interval
            print(
                f"step {step + 1}/{total} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} {ms:.0f} ms/step",
                flush=True,
            )
            t0 = time.perf_counter()
    val_loss = validation_loss(model, val, cfg.train)
    if rank == 0:
        guard.events.emit("validation", guard.step, val_loss=val_loss)
        print(f"final validation loss {val_loss:.4f} state sha256 {guard.state_sha256}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except trainguard.ConfigError as e:  # bad input: one clear line, exit code 2, nothing touched
        trainguard.exit_bad_input(str(e))
