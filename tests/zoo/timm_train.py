"""Zoo shape: timm's ``train.py`` (huggingface/pytorch-image-models), written anew at toy size.

Its shape: ``main()`` builds a small conv net under DDP, SGD with momentum and a scheduler driven by
``step_update(num_updates)`` each update and ``step(epoch)`` each epoch; the epoch loop calls
``train_one_epoch(...)`` then ``validate(...)``; both reduce their metrics across ranks with a
``reduce_tensor`` helper (an all-reduce and a division by the world size), the training loss at its
log interval and the last batch, validation every batch. Guarded as the README says, with an epoch
loop: the first ``next(guard.steps(...))`` resumes, the start epoch and batch follow from it, each
batch takes its step from the same generator and ends with ``guard.step_end``; the images come
through a ``ResumableSampler`` (the Guard's sampler); validation runs in ``guard.section("eval")``.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import trainguard

BATCHES_PER_EPOCH, BATCH, LOG_INTERVAL, CLASSES = 15, 8, 5, 4


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class CosineScheduler:
    """timm's scheduler interface: ``step_update(num_updates)`` per update, ``step(epoch)`` per epoch."""

    def __init__(self, optimizer, base_lr: float, warmup: int, total: int):
        self.optimizer, self.base_lr, self.warmup, self.total = optimizer, base_lr, warmup, total

    def _set(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step_update(self, num_updates: int) -> None:
        if num_updates < self.warmup:
            self._set(self.base_lr * (num_updates + 1) / self.warmup)
        else:
            self._set(0.5 * self.base_lr * (1 + math.cos(math.pi * num_updates / self.total)))

    def step(self, epoch: int, metric: float | None = None) -> None:
        pass  # per update here, as timm's cosine scheduler with t_in_epochs=False


def reduce_tensor(tensor: torch.Tensor, n: int) -> torch.Tensor:
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / n


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(1) == target).float().mean() * 100


def train_one_epoch(epoch, first_batch, model, loader, optimizer, loss_fn, lr_scheduler, steps, guard, world, rank):
    num_updates = epoch * BATCHES_PER_EPOCH + first_batch
    last_idx = BATCHES_PER_EPOCH - 1
    model.train()
    for batch_idx in range(first_batch, BATCHES_PER_EPOCH):
        step = next(steps, None)
        if step is None:
            return False
        input, target = next(loader)
        output = model(input)
        loss = loss_fn(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        num_updates += 1
        if batch_idx == last_idx or batch_idx % LOG_INTERVAL == 0:
            reduced_loss = reduce_tensor(loss.data, world)
            if rank == 0:
                print(f"Train: {epoch} [{batch_idx}/{BATCHES_PER_EPOCH}] loss {reduced_loss.item():.4f}", flush=True)
        lr_scheduler.step_update(num_updates=num_updates)
        guard.step_end(loss=loss)
        say_step(rank, step + 1, STEPS)
    return True


def validate(model, loader, loss_fn, world, rank):
    model.eval()
    losses, top1 = [], []
    with torch.no_grad():
        for input, target in loader:
            output = model(input)
            loss = loss_fn(output, target)
            losses.append(reduce_tensor(loss.data, world).item())
            top1.append(reduce_tensor(accuracy(output, target), world).item())
    model.train()
    if rank == 0:
        print(f"Test: loss {sum(losses) / len(losses):.4f} acc1 {sum(top1) / len(top1):.2f}", flush=True)


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    g = torch.Generator().manual_seed(11)
    images = torch.randn(480, 3, 8, 8, generator=g)
    labels = (images.mean((1, 2, 3)) * 40).long().clamp(-2, 1) + 2
    train_set = TensorDataset(images[:400], labels[:400])
    val_set = TensorDataset(images[400:], labels[400:])
    model = DDP(TinyNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    lr_scheduler = CosineScheduler(optimizer, 0.05, warmup=5, total=STEPS)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    sampler = trainguard.ResumableSampler(len(train_set), rank, world, seed=cfg.run.seed)
    loader_train = DataLoader(train_set, batch_size=BATCH, sampler=sampler, num_workers=0)
    loader_eval = DataLoader(val_set, batch_size=20, sampler=val_set_sampler(len(val_set), rank, world))
    guard = trainguard.Guard(cfg, model=model, optimizer=optimizer, sampler=sampler)
    num_epochs = math.ceil(STEPS / BATCHES_PER_EPOCH)
    steps = guard.steps(STEPS)
    first = next(steps)  # resumes; the step to run first
    steps = itertools.chain([first], steps)
    batches = iter(loader_train)
    start_epoch, first_batch = divmod(first, BATCHES_PER_EPOCH)
    for epoch in range(start_epoch, num_epochs):
        more = train_one_epoch(
            epoch, first_batch, model, batches, optimizer, loss_fn, lr_scheduler, steps, guard, world, rank
        )
        first_batch = 0
        with guard.section("eval"):
            validate(model, loader_eval, loss_fn, world, rank)
        lr_scheduler.step(epoch + 1)
        if not more:
            break
    next(steps, None)  # the Guard's end: the final save
    write_weights_hash(model.module, rank)
    dist.destroy_process_group()


def val_set_sampler(n: int, rank: int, world: int) -> list[int]:
    return list(range(rank, n, world))


if __name__ == "__main__":
    main()
