"""What every zoo script shares that is not part of its loop's shape: the run length, rank 0's
``step N/M`` console line (the drivers kill at a printed step) and the final weights' hash.

``ZOO_STEPS`` sets the optimizer steps of a run (default 60); ``ZOO_HASH_FILE``, when set, is where
rank 0 writes the SHA-256 (hex) of the final model weights: every parameter, in
``named_parameters()`` order, as its contiguous CPU bytes. A sharded (DTensor) parameter is gathered
first, so every rank must call :func:`write_weights_hash`.
"""

from __future__ import annotations

import hashlib
import os

import torch

STEPS = int(os.environ.get("ZOO_STEPS", 60))


def say_step(rank: int, step: int, max_steps: int, loss: float | None = None) -> None:
    """Rank 0 prints ``step N/M`` (N: the 1-based step just completed), as the drivers expect."""
    if rank == 0:
        tail = f" loss {loss:.5f}" if loss is not None else ""
        print(f"step {step}/{max_steps}{tail}", flush=True)


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of the model's parameters' bytes; a collective for a sharded model."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):  # a DTensor (FSDP2): every rank gathers
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_weights_hash(model: torch.nn.Module, rank: int) -> None:
    """Rank 0 writes :func:`weights_sha256` to ``$ZOO_HASH_FILE`` (atomically); a collective for a
    sharded model (every rank calls it), nothing without the variable."""
    path = os.environ.get("ZOO_HASH_FILE")
    if not path:
        return
    digest = weights_sha256(model)
    if rank == 0:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, path)
