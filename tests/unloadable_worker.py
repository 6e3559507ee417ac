"""A DDP loop whose checkpoints a resume could not load, written without complaint (issue 53).

``--wrapper``: the Guard gets a wrapper module shaped like Lightning Fabric's ``_FabricModule``: it
holds the DDP model as ``forward_module``, gives the inner module's attributes, and its
``state_dict()`` is the inner module's (keys ``net.0.weight``), while torch's load looks the
parameters up by their names through the wrapper (``forward_module.net.0.weight``). Without it
the Guard gets the DDP model. Settings come from the launcher (``config_from_env``); 12 steps.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard


class Wrapper(torch.nn.Module):
    """Forwards to the DDP model it holds; its state dict is the plain module's, as Fabric's is."""

    def __init__(self, ddp: DDP):
        super().__init__()
        self.forward_module = ddp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_module(x)

    def __getattr__(self, name: str):  # the inner module's attributes, as Fabric's wrapper gives them
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.forward_module.module, name)

    def state_dict(self, *args, **kwargs):
        return self.forward_module.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.forward_module.module.load_state_dict(state_dict, strict=strict, assign=assign)


def main() -> None:
    cfg = trainguard.config_from_env()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Module()
    net.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    net.forward = lambda x: net.net(x)
    ddp = DDP(net)
    model = Wrapper(ddp) if "--wrapper" in sys.argv else ddp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = trainguard.Guard(cfg, model=model, optimizer=opt)
    for _ in guard.steps(12):
        x = torch.randn(8, 4)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        guard.step_end(loss=loss)
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
