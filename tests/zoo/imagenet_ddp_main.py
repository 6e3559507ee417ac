"""Zoo shape: PyTorch examples' ImageNet ``main.py`` (pytorch/examples ``imagenet/main.py``) in
its DDP form, written anew at toy size.

Its shape: ``main_worker`` reads the rank from the environment, starts the process group, builds
the model under DDP, ``CrossEntropyLoss``, SGD with momentum and a per-epoch ``StepLR``; a
``DistributedSampler`` for the training set, ``train_sampler.set_epoch(epoch)`` at each epoch;
``train(...)`` keeps ``AverageMeter``s and a ``ProgressMeter``; ``validate(...)`` runs under
``torch.no_grad()`` and all-reduces its meters (``meter.all_reduce()``: sum and count in one
all-reduce) before reporting acc@1; ``scheduler.step()`` after each epoch. Guarded as the README
says, with an epoch loop: the first ``next(guard.steps(...))`` resumes, the start epoch and the
batches to skip in it follow from the step (a ``DistributedSampler`` is not resumable by itself;
its order depends on the epoch only), each batch takes its step from the same generator and ends
with ``guard.step_end``; the per-epoch scheduler is the Guard's.
"""

from __future__ import annotations

import itertools
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import trainguard

BATCH, PRINT_FREQ = 8, 5


class AverageMeter:
    def __init__(self, name: str):
        self.name, self.sum, self.count = name, 0.0, 0

    def update(self, val: float, n: int = 1) -> None:
        self.sum += val * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / max(1, self.count)

    def all_reduce(self) -> None:
        total = torch.tensor([self.sum, self.count], dtype=torch.float64)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    return (output.argmax(1) == target).float().mean().item() * 100


def train(train_loader, skip, model, criterion, optimizer, epoch, steps, guard, rank):
    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")
    model.train()
    for i, (images, target) in enumerate(train_loader):
        if i < skip:
            continue  # done before the resume
        step = next(steps, None)
        if step is None:
            return False
        output = model(images)
        loss = criterion(output, target)
        losses.update(loss.item(), images.size(0))
        top1.update(accuracy(output, target), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % PRINT_FREQ == 0 and rank == 0:
            print(f"Epoch: [{epoch}][{i}/{len(train_loader)}] Loss {losses.avg:.4e} Acc@1 {top1.avg:6.2f}", flush=True)
        guard.step_end(loss=loss)
        say_step(rank, step + 1, STEPS)
    return True


def validate(val_loader, model, criterion, rank) -> float:
    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")
    model.eval()
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            losses.update(criterion(output, target).item(), images.size(0))
            top1.update(accuracy(output, target), images.size(0))
    top1.all_reduce()
    losses.all_reduce()
    model.train()
    if rank == 0:
        print(f" * Acc@1 {top1.avg:.3f} Loss {losses.avg:.4f}", flush=True)
    return top1.avg


def main_worker(cfg: trainguard.Config) -> None:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo", init_method="env://", world_size=world_size, rank=rank)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    model = DDP(nn.Sequential(nn.Flatten(), nn.Linear(48, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 5)))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(5)
    images = torch.randn(440, 3, 4, 4, generator=g)
    target = (images.sum((1, 2, 3)) > 0).long() + (images[:, 0].mean((1, 2)) > 0.2).long() * 2
    train_dataset, val_dataset = TensorDataset(images[:400], target[:400]), TensorDataset(images[400:], target[400:])
    train_sampler = DistributedSampler(train_dataset)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=BATCH, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=10, sampler=val_sampler)
    guard = trainguard.Guard(cfg, model=model, optimizer=optimizer, scheduler=scheduler)
    per_epoch = len(train_loader)
    steps = guard.steps(STEPS)
    first = next(steps)  # resumes; the step to run first
    steps = itertools.chain([first], steps)
    start_epoch, skip = divmod(first, per_epoch)
    for epoch in range(start_epoch, math.ceil(STEPS / per_epoch)):
        train_sampler.set_epoch(epoch)
        more = train(train_loader, skip, model, criterion, optimizer, epoch, steps, guard, rank)
        skip = 0
        if not more:
            break
        with guard.section("eval"):
            validate(val_loader, model, criterion, rank)
        scheduler.step()
    next(steps, None)  # the Guard's end: the final save
    write_weights_hash(model.module, rank)
    dist.destroy_process_group()


def main() -> None:
    main_worker(trainguard.config_from_argv())


if __name__ == "__main__":
    main()
