"""A deterministic, resumable, rank-sharded sampler (the data position of the training state)."""

from __future__ import annotations

from typing import Iterator, Optional

import torch


class ResumableSampler:
    """Yields dataset indices for one rank, epoch after epoch, and can resume mid-epoch, on the same
    or another number of ranks.

    Each epoch is a permutation ``perm`` of ``range(num_samples)`` drawn from ``seed + epoch`` (so
    every rank draws the same one). The ranks read it in lockstep, interleaved: from a position
    ``base`` of the epoch, rank ``r``'s ``k``-th index is ``perm[base + k·world_size + r]``, like
    ``torch.utils.data.DistributedSampler`` with ``drop_last=True`` (the same order when
    ``base = 0``). An epoch ends for every rank when fewer than ``world_size`` indices are left
    (at most ``world_size - 1`` samples of an epoch are dropped). Iteration never ends: after an
    epoch the next one starts.

    ``state_dict()`` is ``{"epoch", "consumed"}``: the epoch and how many of its permutation's
    indices all ranks together have taken. It is the same on every rank and does not depend on the
    number of ranks, so a checkpoint resumes on any world size from the same point of the same
    permutation: every sample of an epoch is seen once, none twice (the **resharding contract**;
    ``reshardable = True`` says a sampler keeps it, and a sampler of your own that does should say
    so too; see ``docs/elastic.md``). The ranks must take the same number of indices per step.

    Use it without DataLoader worker prefetch (or with ``num_workers=0``): the position counts the
    indices handed out, which is the data actually consumed only when nothing is prefetched.

    Args:
        num_samples: dataset length (> 0).
        rank, world_size: this rank and the number of ranks.
        seed: base seed of the per-epoch permutation.
        shuffle: False keeps dataset order.
    Raises:
        ValueError: ``num_samples`` smaller than ``world_size``.
    """

    reshardable = True  # state_dict() is world-size independent (see the class doc)

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if num_samples < world_size:
            raise ValueError(f"num_samples={num_samples} is smaller than world_size={world_size}")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.base = 0  # position in the epoch's permutation where this rank's ``offset`` counts from
        self.offset = 0  # indices this rank took since ``base``
        self._batch: Optional[int] = None  # size of the last take()
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            return torch.randperm(self.num_samples, generator=g)
        return torch.arange(self.num_samples)

    @property
    def consumed(self) -> int:
        """Indices of this epoch's permutation that all ranks together have taken."""
        return self.base + self.offset * self.world_size

    def __len__(self) -> int:
        """Indices one rank takes in a whole epoch (``num_samples // world_size``). Iteration does
        not stop there (see the class doc); the length makes a ``DataLoader`` over this sampler
        sized, so a framework's epoch is that many batches and its loop does not fetch ahead
        (Lightning prefetches a batch from a loader without a length, which would move the data
        position past the step being saved)."""
        return self.num_samples // self.world_size

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.consumed + self.world_size > self.num_samples:  # fewer than one per rank left
            self.epoch += 1
            self.base = self.offset = 0
            self._perm = self._permutation(self.epoch)
        idx = int(self._perm[self.consumed + self.rank])
        self.offset += 1
        return idx

    def take(self, n: int) -> list[int]:
        """The next ``n`` indices (a batch)."""
        self._batch = n
        return [next(self) for _ in range(n)]

    def skip_batches(self, n: int) -> None:
        """Skip ``n`` batches of the size of the last :meth:`take` (a rollback's data skip).

        Raises:
            RuntimeError: no batch was taken yet (the batch size is unknown).
        """
        if self._batch is None:
            raise RuntimeError("skip_batches() before any take(): the batch size is unknown")
        for _ in range(n * self._batch):
            next(self)

    def reshard(self, rank: int, world_size: int) -> None:
        """Go on as rank ``rank`` of ``world_size`` from the current global position (the group
        changed size in place, :mod:`trainguard.rejoin.shrink`).

        Raises:
            ValueError: ``num_samples`` smaller than ``world_size``.
        """
        if self.num_samples < world_size:
            raise ValueError(f"num_samples={self.num_samples} is smaller than world_size={world_size}")
        state = self.state_dict()
        self.rank, self.world_size = rank, world_size
        self.load_state_dict(state)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": int, "consumed": int}`` (see the class doc; the same on every rank)."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`, on this sampler's world size. The older form
        ``{"epoch", "offset"}`` (this rank's count, before the position was global) is read as
        written on the same world size."""
        consumed = state["consumed"] if "consumed" in state else int(state["offset"]) * self.world_size
        self.epoch, self.base, self.offset = int(state["epoch"]), int(consumed), 0
        self._perm = self._permutation(self.epoch)
