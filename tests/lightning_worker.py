"""A small Lightning job under trainguard (tests/test_lightning.py), launched by ``trainguard run``.

``python lightning_worker.py MAX_STEPS [--set key=value ...]``: a two-layer regression model with
dropout, AdamW and a warm-up scheduler, trained by ``pytorch_lightning.Trainer`` with DDP on the CPU
(gloo), guarded by :class:`trainguard.lightning.TrainguardCallback`. The data position is a
:class:`trainguard.ResumableSampler`. A validation loop runs every 20 steps (``WORKER_VAL_EVERY=N``:
every N steps; ``WORKER_VAL_EPOCHS=N``: at the end of every N-th epoch instead).

For ``benchmarks/framework_overhead.py``: ``WORKER_HIDDEN`` sets the hidden width (default 64),
``WORKER_PLAIN=1`` leaves the callback out, ``WORKER_TIMES=PATH`` makes rank 0 write each step's
seconds (batch end to batch end) to PATH as JSON.

For tests: ``WORKER_HOLD=N`` makes every rank wait at the end of Lightning's step N (after
trainguard's step end; rank 0 first writes ``RUN_DIR/held``) until trainguard has received a stop
signal, at most 120 s: a test signals the run at a known step whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard
from trainguard.lightning import TrainguardCallback, pl

warnings.filterwarnings("ignore")  # Lightning's advice about workers and logging intervals


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        h = int(os.environ.get("WORKER_HIDDEN", 64))
        self.net = nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Dropout(0.1), nn.Linear(h, 1))

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


class StepTimes(pl.Callback):
    """Rank 0 writes the seconds between consecutive batch ends to ``path`` at the end of fit."""

    def __init__(self, path: str):
        self.path, self.ends = path, []
        self.pad = float(os.environ.get("WORKER_PAD_MS", 0)) / 1e3  # a sleep that lengthens each step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.pad:
            time.sleep(self.pad)
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump([b - a for a, b in zip(self.ends, self.ends[1:])], f)


class HoldForSignal(pl.Callback):
    """At the end of step ``step``, wait (at most 120 s) until ``guard_of()``'s shutdown handler
    has received a stop signal."""

    def __init__(self, step: int, guard_of):
        self.step, self.guard_of = step, guard_of

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            if trainer.global_rank == 0:
                open(os.path.join(self.guard_of().cfg.run.dir, "held"), "w").close()
            deadline = time.monotonic() + 120
            while self.guard_of().shutdown.received is None and time.monotonic() < deadline:
                time.sleep(0.01)


def main() -> None:
    max_steps = int(sys.argv[1])
    cfg = trainguard.config_from_argv(argv=sys.argv[2:])
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    trainguard.seed_everything(cfg.run.seed)
    sampler = trainguard.ResumableSampler(len(data), rank, world, seed=cfg.run.seed)
    callbacks = [StepTimes(os.environ["WORKER_TIMES"])] if "WORKER_TIMES" in os.environ else []
    if not os.environ.get("WORKER_PLAIN"):
        callbacks.append(guarded := TrainguardCallback(cfg, sampler=sampler))
        if "WORKER_HOLD" in os.environ:
            callbacks.append(HoldForSignal(int(os.environ["WORKER_HOLD"]), lambda: guarded.guard))
    # at most an epoch (4 ranks: 16 batches each); WORKER_VAL_EVERY=N validates every N steps
    val_every = int(os.environ.get("WORKER_VAL_EVERY", min(20, len(data) // (8 * world))))
    if os.environ.get("WORKER_VAL_EPOCHS"):  # validate at epoch ends, every WORKER_VAL_EPOCHS epochs
        val_every = None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=max_steps,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        val_check_interval=val_every,
        check_val_every_n_epoch=int(os.environ.get("WORKER_VAL_EPOCHS", 1)),
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(
        Regression(),
        DataLoader(data, batch_size=8, sampler=sampler),
        DataLoader(TensorDataset(x[:64], x[:64].sum(1, keepdim=True).sin()), batch_size=32),
    )


if __name__ == "__main__":
    main()
