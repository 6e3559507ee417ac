"""The process-wide objects a Guard (or the replacement runner) may replace, compared with where
torch and Python define them: shared by tests/test_close.py and its 2-rank worker
(tests/comm_hook_worker.py), which take a census before the Guard and after ``close()``."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from trainguard.rejoin.catch import COLLECTIVES


def replaced(model: Optional[Any] = None) -> list[str]:
    """What is not torch's (or Python's) own now: ``torch.distributed``'s collectives and
    ``init_process_group``, DDP's bucket assignment and constructor, ``clip_grad_norm_``,
    ``Tensor.backward``, ``os.environ``'s class, ``sys.excepthook`` (trainguard's wraps the one it
    found: named by its module), and with a DDP ``model`` its instance's ``register_comm_hook``.
    Compared with where torch defines them, not with an earlier census: a patch that a Guard never
    undid would be in every later census of this process too."""
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.utils import clip_grad

    own = {n: getattr(distributed_c10d, n) for n in (*COLLECTIVES, "init_process_group")}
    own["_compute_bucket_assignment_by_size"] = torch._C._distributed_c10d._compute_bucket_assignment_by_size
    out = [f"torch.distributed.{n}" for n, fn in own.items() if getattr(dist, n, None) is not fn]
    if torch.nn.utils.clip_grad_norm_ is not clip_grad.clip_grad_norm_:
        out.append("torch.nn.utils.clip_grad_norm_")
    for name, fn, where in (
        ("torch.Tensor.backward", torch.Tensor.backward, "torch._tensor.Tensor.backward"),
        (
            "DistributedDataParallel.__init__",
            DistributedDataParallel.__init__,
            "torch.nn.parallel.distributed.DistributedDataParallel.__init__",
        ),
    ):
        if f"{fn.__module__}.{fn.__qualname__}" != where or hasattr(fn, "__wrapped__"):  # functools.wraps
            out.append(name)
    if type(os.environ) is not os._Environ:
        out.append("os.environ's class")
    if getattr(sys.excepthook, "__module__", "").startswith("trainguard"):
        out.append("sys.excepthook")
    if model is not None and "register_comm_hook" in vars(model):
        out.append("DistributedDataParallel.register_comm_hook (on the instance)")
    return out
