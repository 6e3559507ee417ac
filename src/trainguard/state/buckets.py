"""DDP's gradient bucket layout, saved with each checkpoint and imposed on the resumed reducer.

DDP's reducer puts the gradients in buckets, each all-reduced as one flat buffer. It starts from an
initial layout (parameters in reverse order) and rebuilds it once, after its first step, in the
order the gradients became ready. With three or more ranks where a gradient sits in a bucket (its
bucket and its offset in the buffer) decides the order of the sum (the ring all-reduce adds the
ranks' chunks in an order that depends on the position), so its rounding. A resumed process
builds a fresh reducer with the initial layout, where the interrupted run had the rebuilt one: its
sums round differently and the resume is not bitwise identical (measured: 4 ranks of
``examples/plain_loop.py``). :class:`BucketLayout` saves the layout trainguard's communication
hook noted (:attr:`~trainguard.rejoin.catch.DDPHook.layout`) and, at the resume, gives the reducer
that layout (:func:`~trainguard.rejoin.regroup.rebind_ddp`, as in-process recovery does for a
rebuilt reducer); where it cannot, the resume says why (``resume_not_bitwise``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..ranks import RankView

Layout = list[list[int]]

# the fewest ranks whose sum's rounding depends on the order (two summands commute)
ORDERED_SUM_RANKS = 3


class BucketLayout:
    """A Stateful part of every rank's saved state: ``{"layout": [[parameter index, ...] per
    bucket]}`` (empty: unknown: not a DDP model, or no trainguard hook on it).

    Args:
        model: the model the Guard was given (a DDP one is acted on; any other is left alone).
        current: the layout trainguard's hook last noted (``None``: unknown); called at each save.
        ranks: the shared view of the group (:class:`~trainguard.ranks.RankView`): its world size
            now (a shrink or growth in place changes it there).
    """

    def __init__(self, model: torch.nn.Module, current: Callable[[], Optional[Layout]], ranks: RankView):
        self.model, self.current, self.ranks = model, current, ranks
        self.loaded: Optional[Layout] = None

    def state_dict(self) -> dict[str, Any]:
        return {"layout": [list(bucket) for bucket in self.current() or []]}  # a copy: the hook notes in place

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = [list(map(int, bucket)) for bucket in state.get("layout") or []] or None

    def impose(self) -> Optional[str]:
        """After a resume loaded the checkpoint (every rank, at the same point): give a DDP model's
        reducer the layout the checkpoint holds. Returns why the resume cannot be bitwise where it
        cannot (``None``: imposed, not needed, or not a DDP model). Below :data:`ORDERED_SUM_RANKS`
        ranks nothing is done (the sum of two does not depend on the order)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        from ..rejoin.regroup import RegroupError, rebind_ddp

        if not isinstance(self.model, DDP) or self.ranks.world_size < ORDERED_SUM_RANKS:
            return None
        layout, self.loaded = self.loaded, None
        if layout is None:
            return (
                f"the checkpoint holds no DDP bucket layout (written by an older trainguard, or the model has a "
                f"communication hook of its own): the resumed reducer starts from DDP's initial layout, and with "
                f"{self.ranks.world_size} ranks the layout decides the order of the gradients' sum"
            )
        trained = sum(p.requires_grad for p in self.model.parameters())
        if sorted(i for bucket in layout for i in bucket) != list(range(trained)):
            return "the checkpoint's DDP bucket layout does not fit this model's parameters"
        try:
            rebind_ddp(self.model, layout)
        except RegroupError as e:
            return f"the checkpoint's DDP bucket layout cannot be given to the resumed reducer ({e})"
        return None
