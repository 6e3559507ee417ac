"""Zoo shape: PyTorch's DDP tutorial series (``pytorch/examples``,
``distributed/ddp-tutorial-series/multigpu_torchrun.py``), an epoch loop guarded as docs/loops.md
shows.

Its shape: a ``Trainer`` object whose ``train(max_epochs)`` runs ``_run_epoch(epoch)`` for each
epoch, which calls ``sampler.set_epoch(epoch)`` and then ``_run_batch(source, targets)`` for each
batch of ``for source, targets in self.train_data``; ``_run_batch`` zeroes the gradients, runs the
forward, ``F.cross_entropy`` and ``backward`` and steps an SGD optimizer. The data is a
``DistributedSampler`` (``shuffle=True``) read through a ``DataLoader``. Guarded as a new user
would after reading docs/loops.md: the loader is torchdata's ``StatefulDataLoader`` given as
``Guard(sampler=loader)``, the epoch counter is an ``extra_state`` value, and the loop calls
``guard.begin``, ``guard.step_begin``, ``guard.step_end`` and ``guard.finish`` (a ``for batch in
loader`` loop does not iterate ``guard.steps()``). The tutorial's own checkpoint (rank 0,
``torch.save`` every ``save_every`` epochs) is left to the Guard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import trainguard


class Epoch:
    """The epoch counter the Guard saves (``extra_state``)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Trainer:
    def __init__(self, cfg, model: torch.nn.Module, train_data, sampler, optimizer) -> None:
        self.rank = dist.get_rank()
        self.model = DDP(model)
        self.train_data, self.sampler, self.optimizer = train_data, sampler, optimizer
        self.epoch = Epoch()
        self.guard = trainguard.Guard(
            cfg, model=self.model, optimizer=optimizer, sampler=train_data, extra_state={"epoch": self.epoch}
        )

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.guard.step_begin()
            loss = self._run_batch(source, targets)
            self.guard.step_end(loss=loss)
            say_step(self.rank, self.guard.step, STEPS)
            if self.guard.step >= STEPS:
                return
        self.epoch.value += 1

    def train(self, max_steps: int) -> None:
        self.guard.begin(max_steps)
        while self.guard.step < max_steps:
            self._run_epoch(self.epoch.value)
        self.guard.finish()
        self.guard.close()


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(640, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.run.seed)
    train_data = StatefulDataLoader(dataset, batch_size=16, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(cfg, model, train_data, sampler, optimizer)
    trainer.train(STEPS)
    write_weights_hash(trainer.model.module, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
