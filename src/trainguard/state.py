"""Everything a bitwise-identical resume needs besides model and optimizer tensors.

* RNG states: Python ``random``, NumPy's global generator, torch CPU and every CUDA device.
  They are captured as plain containers and tensors so that they load with
  ``torch.load(weights_only=True)`` (no arbitrary pickle).
* :func:`state_hash`: SHA-256 over the model and optimizer state, tensors in sorted key order, so
  that two runs compare by one string.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy and torch (CPU and CUDA) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    """Return the current RNG states as a ``weights_only``-loadable dict."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture_rng`.

    Raises:
        KeyError: ``state`` lacks the Python, NumPy or torch entry.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _update_with(h: "hashlib._Hash", key: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if hasattr(t, "full_tensor"):  # DTensor: hash the global tensor
            t = t.full_tensor()
        t = t.cpu().contiguous()
        h.update(f"{key}:{t.dtype}:{list(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _update_with(h, f"{key}.{k}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _update_with(h, f"{key}.{i}", v)
    else:
        h.update(f"{key}={json.dumps(value, default=str)}\n".encode())


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """SHA-256 (hex) of the model's and optimizer's state.

    Keys are visited in sorted order; each tensor contributes its key, dtype, shape and raw bytes,
    each scalar its JSON text. The optimizer state is taken in fully-qualified-name form
    (``torch.distributed.checkpoint.state_dict.get_state_dict``), so the hash does not depend on
    parameter ids and is the same for a DDP-wrapped and a plain model.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    h = hashlib.sha256()
    _update_with(h, "model", model_sd)
    if optimizer is not None:
        _update_with(h, "optim", optim_sd)
    return h.hexdigest()
