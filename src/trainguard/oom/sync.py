"""Gradient averaging for DDP models under ``run_step``: overlapped with backward, and safe when a rank runs out of memory.

DDP's own reducer starts each bucket's all-reduce during backward; if one rank runs out of memory
mid-step its peers wait inside those all-reduces for good. :class:`GradSync` does the same job in
a way that a failing rank can finish: every micro-batch runs under ``no_sync()``; each gradient is
a view into a persistent flat bucket buffer (as with DDP's ``gradient_as_bucket_view``), so
backward accumulates in place; during the *last* micro-batch's backward a post-accumulate-grad hook
launches each bucket's asynchronous all-reduce once all its gradients are in, always in bucket
order (reverse parameter order, the order backward produces them). The last bucket carries one
slot per rank for the out-of-memory code, then the values of the instability detectors and the stop
check that the caller's ``extra`` gives (:mod:`trainguard.instability.fold`). A rank that fails launches the buckets it has not yet
launched, in the same order, with its code set, so every rank issues the same collectives and
every rank reads the same codes; the gradients are kept only if all codes are zero. The
micro-batch losses are pre-divided by the world size, so the sum over ranks is the mean (DDP
divides by the world size too).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], extra: int):
        self.params = params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.buffer = torch.zeros(n + extra, dtype=params[0].dtype, device=params[0].device)
        self.pending = 0
        self.work: Optional[dist.Work] = None


class GradSync:
    """Bucketed, overlapped gradient all-reduce that carries per-rank out-of-memory codes.

    Args:
        params: the model's parameters (those with ``requires_grad`` are averaged).
        rank, world_size: this rank and the group size.
        bucket_bytes: bytes per bucket (a larger parameter gets a bucket of its own).
        extra: ``(size, values)``: ``size`` more slots in the last bucket, filled by ``values(buffer)``
            (a tensor of that size, or ``None``: zeros) when it is sent; their sums are
            :attr:`extra_values` after :meth:`finish`.

    Memory: one persistent buffer per bucket, the size of the gradients (the gradients are views
    into it). Use per step: :meth:`begin` before the first micro-batch, :meth:`arm` before the last
    one's backward, :meth:`finish` after it (or after an out-of-memory error).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        rank: int,
        world_size: int,
        bucket_bytes: int,
        extra: Optional[tuple[int, Callable[[torch.Tensor], Optional[torch.Tensor]]]] = None,
    ):
        self.rank, self.world = rank, world_size
        self.extra_size, self._extra = extra if extra is not None else (0, None)
        self.extra_values: Optional[torch.Tensor] = None  # the last step's summed extra slots
        params = [p for p in params if p.requires_grad]
        groups: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in reversed(params):  # backward produces the last layers' gradients first
            nbytes = p.numel() * p.element_size()
            same = groups and (groups[-1][0].device, groups[-1][0].dtype) == (p.device, p.dtype)
            if not same or size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        last = len(groups) - 1
        self.buckets = [_Bucket(g, world_size + self.extra_size if i == last else 0) for i, g in enumerate(groups)]
        self.where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.armed = False
        self.launched = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def close(self) -> None:
        """Remove the gradient hooks (safe to call twice)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin(self) -> None:
        """Zero the buffers and make every gradient a view into them (before the first micro-batch)."""
        for b in self.buckets:
            b.buffer.zero_()
            b.pending, b.work = len(b.params), None
            for p, off in zip(b.params, b.offsets):
                p.grad = b.buffer[off : off + p.numel()].view_as(p)
        self.armed, self.launched = False, 0

    def arm(self) -> None:
        """The next backward is the step's last: launch each bucket as soon as it is complete."""
        self.armed = True

    def _ready(self, p: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        bucket, _ = self.where[p]
        bucket.pending -= 1
        while self.launched < len(self.buckets) and self.buckets[self.launched].pending <= 0:
            self._launch()

    def _launch(self) -> None:
        b = self.buckets[self.launched]
        if self._extra is not None and self.launched == len(self.buckets) - 1:
            values = self._extra(b.buffer)
            if values is not None:
                b.buffer[b.numel + self.world :] = values
        b.work = dist.all_reduce(b.buffer, async_op=True)
        self.launched += 1

    def finish(self, code: int) -> list[int]:
        """Launch the buckets not yet launched (parameters without a gradient contribute zeros),
        wait for all, and return every rank's code (index into ``oom.PHASES``; all zero = keep).

        Args:
            code: this rank's code (0 = its micro-batches all ran).
        """
        self.armed = False
        last = self.buckets[-1]
        if self.launched < len(self.buckets):
            last.buffer[last.numel :] = 0
            last.buffer[last.numel + self.rank] = code
        while self.launched < len(self.buckets):
            self._launch()
        try:
            for b in self.buckets:
                b.work.wait()
        finally:  # a failed collective's work holds its group's connections: let them go with the group
            for b in self.buckets:
                b.work = None
        tail = last.numel + self.world
        self.extra_values = last.buffer[tail:].clone() if self.extra_size else None
        return [int(round(c)) for c in last.buffer[last.numel : tail].tolist()]
