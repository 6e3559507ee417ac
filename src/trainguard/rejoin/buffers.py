"""A DDP model's buffers in in-process recovery: their broadcast, where a lost peer can be caught,
and their state at the step's start, for a step done again.

A ``DistributedDataParallel`` model with buffers (batch norm's running statistics: every ResNet)
changes them in its forward. Two things follow for in-process recovery:

* **The step's start.** A step abandoned because a peer was lost has run its forward: the running
  statistics moved. Done again after the recovery, the forward would move them a second time, and
  the run would end with other weights than one without the failure, silently. :class:`BufferSync`
  keeps the buffers as the step's first forward starts with them and puts them back for the redo
  (:meth:`BufferSync.restore`, called with the optimizer's and scheduler's step start).
* **The broadcast.** With ``broadcast_buffers`` (the default) DDP starts each forward with a
  broadcast of the buffers from rank 0, inside its forward, where nothing of trainguard's sees its
  error: a survivor whose peer died there raised out of the script and the group restarted.
  :class:`BufferSync` takes that broadcast over: DDP's own is turned off (``forward_sync_buffers =
  False``, a public attribute) and the same buffers are broadcast from rank 0 in a forward pre-hook,
  in the same forwards DDP would (``require_forward_param_sync``: not after a forward under
  ``no_sync()``), one broadcast per dtype and device. A broadcast copies rank 0's bytes, so the
  buffers are the ones DDP's broadcast would have left, bit for bit, and the flat copy it sent is
  the step's start, kept at no cost. A lost peer there is recorded like one in any other collective
  (:mod:`.catch`), the forward goes on with this rank's own buffers, and the step is done again after
  the recovery. Before the broadcast, its site is compared for alignment after a meeting
  (:mod:`.align`).

:meth:`BufferSync.close` gives DDP its broadcast back.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .align import DDP_FORWARD
from .catch import CATCHING, LOCAL, Catch


def has_buffers(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a DDP model with buffers (:class:`BufferSync` applies)."""
    return isinstance(model, DDP) and bool(_buffers(model))


def _buffers(model: DDP) -> list[torch.Tensor]:
    """The buffers DDP broadcasts: the module's, less those it was told to ignore."""
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    return [b for name, b in model.module.named_buffers() if name not in ignored]


class BufferSync:
    """A DDP model's buffers kept at the step's start and, with ``broadcast_buffers``, broadcast
    before each forward in DDP's stead (see the module's doc).

    Args:
        model: a DDP model for which :func:`has_buffers` holds.
        catch: where a lost peer is recorded (``catch.on_failure``) and asked for (``catch.failed()``).

    Cost: none beyond DDP's own with ``broadcast_buffers`` (the broadcast's flat copies are the kept
    state); without it, one copy of the buffers per dtype at each step's first forward.
    """

    def __init__(self, model: DDP, catch: Catch):
        self.model, self.catch = model, catch
        self.sync = bool(model.forward_sync_buffers)
        self._was = model.forward_sync_buffers
        model.forward_sync_buffers = False
        self._handle: Optional[Any] = model.register_forward_pre_hook(self._before_forward)
        self._fresh = True  # the next forward is the step's first
        self.forward: Any = None  # a RollForward (.forward) where [recovery] roll_forward applies
        self._start: Optional[tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = None

    def new_step(self) -> None:
        """A step begins: its first forward keeps the buffers as they start it."""
        self._fresh = True

    def restore(self) -> None:
        """Put the buffers back as the current step's first forward started with them (a step
        done again); nothing before a forward of the step."""
        if self._start is None or self._fresh:
            return
        groups, flats = self._start
        with torch.no_grad():
            for same, flat in zip(groups, flats):
                _unflatten(same, flat)

    @contextmanager
    def at_step_start(self) -> Iterator[None]:
        """``with buffer_sync.at_step_start(): ...``: the buffers as the current step's first forward
        started with them inside the block (a rolled-forward recovery sends them to a replacement,
        which runs that forward again), as they are now after it."""
        if self._start is None or self._fresh:
            yield
            return
        now = [_flat(same) for same in self._start[0]]
        self.restore()
        try:
            yield
        finally:
            with torch.no_grad():
                for same, flat in zip(self._start[0], now):
                    _unflatten(same, flat)

    def _before_forward(self, module: DDP, args: Any) -> None:
        first, self._fresh = self._fresh, False
        groups = _grouped(_buffers(module))
        flats = self._broadcast(module, groups, first) if self.sync and module.require_forward_param_sync else None
        if first:
            self._start = (groups, flats if flats is not None else [_flat(same) for same in groups])

    def _broadcast(self, module: DDP, groups: list[list[torch.Tensor]], first: bool) -> Optional[list[torch.Tensor]]:
        """Broadcast the buffers from rank 0; their flat copies, or ``None`` where nothing was sent
        (a peer was lost: in this broadcast, recorded, or earlier in the step). Rolled forward
        (:attr:`forward`), a loss caught here at the step's first forward is met here: the step is
        not done again, the broadcast goes again over the new group, where the replacement's first
        forward sends it too."""
        if self.catch.align.open:
            self.catch.align.at(DDP_FORWARD, alone_ok=False)
        forward = self.forward
        meeting = first and forward is not None and forward.ahead < 0  # a replacement: the survivors wait here
        if self.catch.mode == LOCAL and not meeting:  # a replacement before it met the survivors: they are not here
            return None  # (its buffers came from them: the broadcast's result at the step's start)
        if self.catch.mode == CATCHING and self.catch.failed():
            return None  # a peer was lost in this step: the forward runs on this rank's own buffers
        try:
            flats = broadcast(groups, module.process_group)
        except Exception as e:
            if self.catch.mode != CATCHING or not self.catch.on_failure(e, "forward"):
                raise
            if not (first and forward is not None):
                return None
            forward.lost_at_forward()  # the meeting (it raises where it fails)
            return broadcast(groups, module.process_group)
        if meeting:
            forward.met_at_forward()
        return flats

    def close(self) -> None:
        """Give DDP its own broadcast back and remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self.model.forward_sync_buffers = self._was


def _grouped(buffers: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in buffers:
        groups.setdefault((b.dtype, b.device), []).append(b)
    return list(groups.values())


def _flat(same: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([b.reshape(-1) for b in same])


def _unflatten(same: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for b in same:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()


def broadcast(groups: list[list[torch.Tensor]], group: Any) -> list[torch.Tensor]:
    """Broadcast buffers (grouped by dtype and device) from rank 0 of ``group`` in place, one flat
    broadcast per group; returns the flat tensors sent (rank 0's values)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    flats = []
    with torch.no_grad():
        for same in groups:
            flat = _flat(same)
            dist.broadcast(flat, src, group=group)
            _unflatten(same, flat)
            flats.append(flat)
    return flats
