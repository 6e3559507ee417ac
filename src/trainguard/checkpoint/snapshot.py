"""Host-memory snapshots of the training state, with buffers reused from one save to the next.

An asynchronous save blocks training only for :meth:`Snapshot.take`: every tensor of the state is
copied into a host buffer, and the background writer then works from those copies while training
changes the originals. Buffers are kept between saves (keyed by their path in the state tree), so a
steady run allocates them once; on CUDA they are pinned, so the device→host copies run as DMA and
the snapshot ends with one ``torch.cuda.synchronize()`` (torchtitan and PyTorch's async DCP stage
the same way). DTensors are copied shard by shard (``to_local()``) and rewrapped with the same mesh
and placements, so DCP still sees the sharding.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover  (old torch)
    DTensor = None  # type: ignore[assignment,misc]


class Snapshot:
    """Copies a nested state (dicts, lists, tuples of tensors and plain values) into host buffers.

    Not thread-safe: the caller must not take a new snapshot while a writer still reads the
    previous one (the async saver waits for the previous save first).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0  # bytes of tensor data in the last snapshot

    def take(self, state: Any) -> Any:
        """Return a copy of ``state`` whose tensors live in this snapshot's host buffers.

        Non-tensor leaves (ints, floats, strings, small dicts in ``param_groups``) are deep-copied.
        Raises:
            RuntimeError: a device→host copy failed (for instance CUDA out of host memory for a pin).
        """
        self.bytes = 0
        cuda_seen = [False]
        out = self._copy(state, "", cuda_seen)
        if cuda_seen[0]:
            torch.cuda.synchronize()  # the non_blocking copies into pinned buffers must land
        return out

    def _copy(self, obj: Any, path: str, cuda_seen: list[bool]) -> Any:
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._tensor(obj.to_local(), path, cuda_seen)
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, cuda_seen)
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}/{k}", cuda_seen) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}", cuda_seen) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: str, cuda_seen: list[bool]) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        if t.is_cuda:
            cuda_seen[0] = True
            buf.copy_(t, non_blocking=True)
        else:
            buf.copy_(t)
        self.bytes += buf.numel() * buf.element_size()
        return buf

    def release(self) -> None:
        """Drop the buffers (they are re-allocated by the next :meth:`take`)."""
        self._buffers.clear()
