"""Small helpers over ``torch.distributed`` that also work in a single process without a group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_dist() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if is_dist() else 1


def backend() -> str | None:
    """The default group's backend (``"gloo"``, ``"nccl"``), ``None`` without a process group."""
    return dist.get_backend() if is_dist() else None


def barrier(group: Any = None) -> None:
    """Barrier across all ranks (of ``group``, default the world); no-op in a single process."""
    if is_dist():
        dist.barrier(group=group)


def destroy() -> None:
    """Destroy the default process group, if any (before a deliberate exit)."""
    if is_dist():
        dist.destroy_process_group()


def destroy_group(group: Any) -> None:
    """Destroy a process group this process created with ``new_group`` (no-op for ``None``, or when
    the default group is already gone, which takes every group with it)."""
    if group is not None and is_dist():
        dist.destroy_process_group(group)


def all_reduce_max(values: list[int], group: Any = None) -> list[int]:
    """Element-wise max of a short int vector across ranks, in one collective.

    Args:
        values: per-rank flags or small integers.
        group: process group (default the world).
    Returns:
        The maxima, same length. On CUDA-only backends (NCCL) the tensor goes through the device.
    """
    if not is_dist():
        return list(values)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Send a picklable object from global rank ``src`` to every rank (of ``group``) and return it."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """All-gather one picklable object per rank (of ``group``); returns the list indexed by rank."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_cpu_group() -> Any:
    """A new gloo process group over all ranks (``None`` in a single process).

    Background work (the checkpoint writer, the liveness ping) runs its collectives on a group of
    its own: sharing the training group with DDP's all-reduces from another thread can mismatch
    collectives (measured: ``dcp.async_save`` on the default gloo group timed out). A collective
    itself: every rank must call it, in the same order as other ``new_group`` calls.
    """
    return dist.new_group(backend="gloo") if is_dist() else None
