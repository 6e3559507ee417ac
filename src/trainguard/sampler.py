"""A deterministic, resumable, rank-sharded sampler (the data position of the training state)."""

from __future__ import annotations

from typing import Iterator, Optional

import torch


class ResumableSampler:
    """Yields dataset indices for one rank, epoch after epoch, and can resume mid-epoch.

    Each epoch is a permutation of ``range(num_samples)`` drawn from ``seed + epoch`` (so every
    rank draws the same one), cut to a multiple of ``world_size`` and strided by rank, like
    ``torch.utils.data.DistributedSampler`` with ``drop_last=True``. Iteration never ends: after the
    last index of an epoch the next epoch starts. ``state_dict()`` is ``{"epoch", "offset"}``:
    the epoch and how many of this rank's indices were already yielded in it.

    Use it without DataLoader worker prefetch (or with ``num_workers=0``): the offset counts the
    indices handed out, which is the data actually consumed only when nothing is prefetched.

    Args:
        num_samples: dataset length (> 0).
        rank, world_size: this rank and the number of ranks.
        seed: base seed of the per-epoch permutation.
        shuffle: False keeps dataset order.
    Raises:
        ValueError: ``num_samples`` smaller than ``world_size``.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if num_samples < world_size:
            raise ValueError(f"num_samples={num_samples} is smaller than world_size={world_size}")
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.per_rank = num_samples // world_size
        self.epoch = 0
        self.offset = 0
        self._batch: Optional[int] = None  # size of the last take()
        self._indices = self._epoch_indices(0)

    def _epoch_indices(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_samples, generator=g)
        else:
            perm = torch.arange(self.num_samples)
        return perm[: self.per_rank * self.world_size][self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.offset >= self.per_rank:
            self.epoch += 1
            self.offset = 0
            self._indices = self._epoch_indices(self.epoch)
        idx = int(self._indices[self.offset])
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

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": int, "offset": int}``."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`."""
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._indices = self._epoch_indices(self.epoch)
