"""A GPT-trainer-shaped data loop (issue 53): batches drawn with ``data_iter = iter(loader)`` /
``next(data_iter)`` / a new iterator at ``StopIteration``, from a ``DataLoader`` with 2 workers over
``RandomSampler(replacement=True, num_samples=...)``, whose position no checkpoint holds.
``--resumable``: the loader's sampler is a ``trainguard.ResumableSampler`` given to the Guard too
(without workers: its position counts the indices handed out). ``--stateful``: the loader is
torchdata's ``StatefulDataLoader`` (2 workers, shuffled) given as ``Guard(sampler=loader)``, its
iterator made in the loop's first step (after the resume); ``--early``: made above ``guard.steps()``
as the GPT trainer does (the position loaded at the resume never reaches it). ``--steps N``
(default 10).
Settings come from the launcher (``config_from_env``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import trainguard


def main() -> None:
    cfg = trainguard.config_from_env()
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(1, keepdim=True))
    if "--stateful" in sys.argv:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, batch_size=8, shuffle=True, num_workers=2)
        sampler = loader
    elif "--resumable" in sys.argv:
        sampler = trainguard.ResumableSampler(len(data), dist.get_rank(), dist.get_world_size(), seed=cfg.run.seed)
        loader = DataLoader(data, batch_size=8, sampler=sampler)
    else:
        sampler = None
        loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data, True, 4096), num_workers=2)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt, sampler=sampler)
    data_iter = iter(loader) if "--stateful" not in sys.argv or "--early" in sys.argv else None
    for _ in guard.steps(steps):
        if data_iter is None:
            data_iter = iter(loader)
        try:
            xb, yb = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            xb, yb = next(data_iter)
        loss = (model(xb) - yb).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
