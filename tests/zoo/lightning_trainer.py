"""Zoo shape: a PyTorch Lightning ``Trainer`` fit with trainguard's callback, as docs/lightning.md shows.

Its shape: a ``LightningModule`` with ``training_step``, a ``validation_step`` that logs with
``sync_dist=True`` (an all-reduce) every ``VAL_EVERY`` steps, ``configure_optimizers`` returning
AdamW and a per-step warm-up scheduler; ``Trainer(strategy="ddp", max_steps=...)`` on the CPU;
the data through a ``ResumableSampler`` (``use_distributed_sampler=False``); trainguard's
``TrainguardCallback`` and a callback that prints rank 0's step after it.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn as nn
from _zoo import STEPS, say_step, write_weights_hash
from torch.utils.data import DataLoader, TensorDataset

import trainguard
from trainguard.lightning import TrainguardCallback, pl

warnings.filterwarnings("ignore")
VAL_EVERY = 20


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintStep(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        say_step(trainer.global_rank, trainer.global_step, STEPS)


def main() -> None:
    cfg = trainguard.config_from_env()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    trainguard.seed_everything(cfg.run.seed)
    sampler = trainguard.ResumableSampler(len(data), rank, world, seed=cfg.run.seed)
    module = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=STEPS,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        val_check_interval=VAL_EVERY,
        num_sanity_val_steps=0,
        callbacks=[TrainguardCallback(cfg, sampler=sampler), PrintStep()],
    )
    trainer.fit(
        module,
        DataLoader(data, batch_size=8, sampler=sampler),
        DataLoader(TensorDataset(x[:64], x[:64].sum(1, keepdim=True).sin()), batch_size=32),
    )
    write_weights_hash(module, trainer.global_rank)


if __name__ == "__main__":
    main()
