"""The loops people write, guarded (docs/loops.md shows each one; tests/test_loops.py runs each,
stops it at a checkpoint, relaunches it and compares the final weights with an uninterrupted run's)::

    trainguard run --nproc-per-node 2 --run-dir runs/epoch examples/loops.py --set loops.shape=epoch

Shapes (``[loops] shape``):

* ``epoch``: ``for epoch ...: sampler.set_epoch(epoch); for batch in loader:``, a
  ``DistributedSampler`` read through torchdata's ``StatefulDataLoader``, which the Guard saves;
* ``workers``: a ``next(data_iter)`` loop over a ``StatefulDataLoader`` with 2 worker processes;
* ``no_optimizer``: a hand-written SGD update instead of a torch optimizer, under ``should_step``;
* ``hidden``: a GRU whose hidden state is carried from batch to batch (truncated backpropagation
  through time), saved as an ``extra_state`` value.

Rank 0 prints ``step N/M loss L`` and writes the final weights' SHA-256 to ``[loops] hash_file``
when it is set.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

import trainguard


class LoopsSection(trainguard.Section):
    shape: str = Field("epoch", pattern="^(epoch|workers|no_optimizer|hidden)$")
    max_steps: int = Field(40, ge=1)
    hash_file: str = ""


class LoopsConfig(trainguard.Config):
    loops: LoopsSection = LoopsSection()


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=gen)
    return TensorDataset(x, (x @ torch.randn(8, 1, generator=gen)).tanh())


class Epoch:
    """The epoch counter, as a Guard ``extra_state`` value: a resume at an epoch's last batch goes on
    in that epoch (its loader then ends at once) and the next begins as it would have."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def epoch_loop(cfg: LoopsConfig, model: torch.nn.Module) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.run.seed, drop_last=True)
    loader = StatefulDataLoader(dataset, batch_size=16, sampler=sampler, generator=torch.Generator())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    epoch = Epoch()
    guard = trainguard.Guard(cfg, model=model, optimizer=opt, sampler=loader, extra_state={"epoch": epoch})
    max_steps = cfg.loops.max_steps
    guard.begin(max_steps)  # resumes: the loader's position and the epoch are loaded here
    while guard.step < max_steps:
        sampler.set_epoch(epoch.value)  # before iter(loader): the epoch's permutation
        for x, y in loader:  # after a resume: from the saved position in this epoch
            guard.step_begin()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            guard.step_end(loss=loss)
            if guard.step >= max_steps:
                break
        else:
            epoch.value += 1  # the loader ran out: the next epoch
    guard.finish()
    guard.close()


def workers_loop(cfg: LoopsConfig, model: torch.nn.Module) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(data(), batch_size=16, shuffle=True, num_workers=2, generator=torch.Generator())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt, sampler=loader)
    data_iter = None
    for _ in guard.steps(cfg.loops.max_steps):
        if data_iter is None:
            data_iter = iter(loader)  # after the resume: from the saved position
        try:
            x, y = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            x, y = next(data_iter)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
    guard.close()


def no_optimizer_loop(cfg: LoopsConfig, model: torch.nn.Module) -> None:
    sampler = trainguard.ResumableSampler(512, dist.get_rank(), dist.get_world_size(), seed=cfg.run.seed)
    dataset = data()
    guard = trainguard.Guard(cfg, model=model, sampler=sampler)  # no optimizer: the update is the loop's
    for _ in guard.steps(cfg.loops.max_steps):
        x, y = dataset[sampler.take(16)]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if guard.should_step(loss):  # False: a NaN or a spike, the update is skipped
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
        model.zero_grad()
        guard.step_end(loss=loss)
    guard.close()


class Hidden:
    """The GRU's hidden state carried across batches, as a Guard ``extra_state`` value."""

    def __init__(self) -> None:
        self.h = torch.zeros(1, 4, 16)

    def state_dict(self) -> dict:
        return {"h": self.h}

    def load_state_dict(self, state: dict) -> None:
        self.h = state["h"]


class Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(8, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, h = self.gru(x, h)
        return self.head(out), h


def hidden_loop(cfg: LoopsConfig, model: torch.nn.Module) -> None:
    tokens = torch.randn(4, 4096, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hidden = Hidden()
    guard = trainguard.Guard(cfg, model=model, optimizer=opt, extra_state={"hidden": hidden})
    for step in guard.steps(cfg.loops.max_steps):
        window = tokens[:, step * 8 : step * 8 + 9]  # 8 inputs, the next value as the target
        pred, h = model(window[:, :-1], hidden.h)
        loss = F.mse_loss(pred, window[:, 1:, :1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        hidden.h = h.detach()  # carried to the next batch, without its graph
        guard.step_end(loss=loss)
    guard.close()


def main() -> None:
    cfg = trainguard.config_from_argv(LoopsConfig)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    shape = cfg.loops.shape
    if shape == "hidden":
        model = DDP(Recurrent())
    else:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    loops = {"epoch": epoch_loop, "workers": workers_loop, "no_optimizer": no_optimizer_loop, "hidden": hidden_loop}
    loops[shape](cfg, model)
    if cfg.loops.hash_file and dist.get_rank() == 0:  # DDP's replicas are alike: rank 0's weights
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        with open(cfg.loops.hash_file, "w") as f:
            f.write(digest.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
