"""Host-memory snapshots of the training state, with buffers reused from one save to the next.

An asynchronous save blocks training only for :meth:`Snapshot.take`: the tensors that training may
change at any moment (module buffers such as BatchNorm statistics) are copied into host buffers at
once; parameters and optimizer states, which change only in ``optimizer.step()``, can be copied in
the background while the next forward and backward run (the Guard waits for that copy before the
next optimizer step), and the writer then works from the copies. Buffers are kept between saves (keyed by their path in the state tree), so a
steady run allocates them once; on CUDA they are pinned, so the device→host copies run as DMA and
the snapshot ends with one ``torch.cuda.synchronize()`` (torchtitan and PyTorch's async DCP stage
the same way). DTensors are copied shard by shard (``to_local()``) and rewrapped with the same mesh
and placements, so DCP still sees the sharding.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

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

    def take(self, state: Any, defer: Callable[[torch.Tensor], bool] = lambda t: False) -> tuple[Any, list]:
        """Return a copy of ``state`` whose tensors live in this snapshot's host buffers.

        Non-tensor leaves (ints, floats, strings, small dicts in ``param_groups``) are deep-copied now.
        Tensors for which ``defer(tensor)`` is true are not copied yet: they come back as
        ``(buffer, source)`` pairs for :func:`copy_pairs`, to run while training goes on (valid
        while the sources do not change: parameters and optimizer states change only in
        ``optimizer.step()``).

        Returns:
            ``(copy of state, deferred pairs)``.
        Raises:
            RuntimeError: a device→host copy failed (for instance no host memory for a pinned buffer).
        """
        self.bytes = 0
        now: list = []
        later: list = []
        out = self._copy(state, "", now, later, defer)
        copy_pairs(now)
        return out, later

    def _copy(self, obj: Any, path: str, now: list, later: list, defer: Callable[[torch.Tensor], bool]) -> Any:
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._tensor(obj.to_local(), path, now, later, defer)
            return DTensor.from_local(
                local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, now, later, defer)
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}/{k}", now, later, defer) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}", now, later, defer) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)

    def _tensor(
        self, t: torch.Tensor, path: str, now: list, later: list, defer: Callable[[torch.Tensor], bool]
    ) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[path] = buf
        (later if defer(t) else now).append((buf, t))
        self.bytes += buf.numel() * buf.element_size()
        return buf

    def release(self) -> None:
        """Drop the buffers (they are re-allocated by the next :meth:`take`)."""
        self._buffers.clear()


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(buffer, source)`` pair; device→host copies run asynchronously into pinned
    buffers and are waited for once at the end."""
    cuda = False
    for buf, src in pairs:
        cuda |= src.is_cuda
        buf.copy_(src, non_blocking=src.is_cuda)
    if cuda:
        torch.cuda.synchronize()
