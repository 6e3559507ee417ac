"""Start-up preflight (``[health] preflight``): fail before training, not hours into it.

Checks, on every rank, before the first step:

* the checkpoint directory can be created and written (a probe file is written, fsynced, removed);
* its filesystem has room for ``keep_last + 1`` checkpoints (retention deletes the oldest only
  after a new one is committed), sized from the newest committed checkpoint's manifest if there is
  one, else estimated from the model and optimizer tensors (parameters × 3 for Adam-style
  optimizers before the optimizer state exists);
* the devices are visible and the same kind on every rank (device type, CUDA device count and name,
  gathered from all ranks), so a node that lost a GPU is named before it hangs a collective;
* GPU health (:func:`trainguard.health.gpu.gpu_report`): "skipped: no GPU" on a machine without one.

A failed check raises :class:`PreflightError` naming what was checked, where, and what was found;
the Guard turns it into exit code 2 before training. Every result is a ``preflight`` event.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any, Optional

import torch

from .. import dist as tgdist


class PreflightError(RuntimeError):
    """A start-up check failed (the message names the check, the path or rank, and the numbers)."""


def check_writable(directory: Path, what: str = "checkpoint dir") -> None:
    """Create ``directory`` and write, fsync and remove a probe file in it.

    Args:
        what: how the error names the directory (``"checkpoint dir"``, ``"checkpoint.local.dir"``).
    Raises:
        PreflightError: it cannot be created or written (names it and the OS error).
    """
    probe = directory / f".preflight-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise PreflightError(f"{what} {directory} is not writable: {e.strerror or e}") from None


def state_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Bytes of this rank's model and optimizer tensors; before the optimizer has state, the
    parameters count three times (weights and two Adam moments)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = 0
    if optimizer is not None:
        for st in optimizer.state.values():
            opt += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return params + (opt if opt else 2 * params)


def check_free_space(directory: Path, checkpoint_bytes: int, count: int) -> dict[str, Any]:
    """Require ``count × checkpoint_bytes`` free bytes on ``directory``'s filesystem.

    Returns:
        ``{"free_bytes", "needed_bytes", "checkpoint_bytes", "count"}``.
    Raises:
        PreflightError: not enough room (names the directory and both sizes).
    """
    free = shutil.disk_usage(directory).free
    needed = count * checkpoint_bytes
    if free < needed:
        raise PreflightError(
            f"not enough free space for checkpoints in {directory}: {count} checkpoints of ~{checkpoint_bytes / 2**20:.1f} MiB "
            f"(checkpoint.keep_last + 1) need {needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free; "
            "free space, lower checkpoint.keep_last, or point checkpoint.dir elsewhere"
        )
    return {"free_bytes": free, "needed_bytes": needed, "checkpoint_bytes": checkpoint_bytes, "count": count}


def device_summary(device: torch.device) -> dict[str, Any]:
    """This rank's devices: host, the training device type, CUDA device count and the device's name."""
    out: dict[str, Any] = {
        "host": socket.gethostname(),
        "type": device.type,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
    return out


def check_devices(summaries: list[dict[str, Any]]) -> None:
    """All ranks train on the same kind of device (type and name) and every host sees devices alike.

    Raises:
        PreflightError: names the ranks and hosts that differ from rank 0.
    """
    ref = summaries[0]
    odd = [(r, s) for r, s in enumerate(summaries) if (s["type"], s.get("name")) != (ref["type"], ref.get("name"))]
    if ref["type"] == "cuda":
        odd += [(r, s) for r, s in enumerate(summaries) if s["cuda_devices"] == 0 and (r, s) not in odd]
    if odd:
        listed = ", ".join(
            f"rank {r} on {s['host']}: {s['type']} {s.get('name', '')} ({s['cuda_devices']} CUDA devices)".strip()
            for r, s in odd
        )
        raise PreflightError(
            f"devices differ across ranks (rank 0 on {ref['host']}: {ref['type']} {ref.get('name', '')}); {listed}"
        )


def run_preflight(
    directory: Path,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    keep_last: int,
    newest_checkpoint_bytes: Optional[int],
    device: torch.device,
    gpu_check: bool = True,
) -> dict[str, Any]:
    """All checks for this rank (a collective: the device summaries are gathered from every rank).

    Args:
        newest_checkpoint_bytes: size of the newest committed checkpoint (all ranks' files), if any;
            else the estimate is this rank's state × world size (an upper bound for DDP).
    Returns:
        The results, for the ``preflight`` event.
    Raises:
        PreflightError: the first check that failed.
    """
    check_writable(directory)
    size = newest_checkpoint_bytes or state_bytes(model, optimizer) * tgdist.world_size()
    space = check_free_space(directory, size, keep_last + 1)
    summaries = tgdist.gather_objects(device_summary(device))
    check_devices(summaries)
    result: dict[str, Any] = {"space": space, "devices": summaries[tgdist.rank()]}
    if gpu_check:
        from .gpu import gpu_report

        result["gpu"] = gpu_report()
    return result
