"""Resume on another world size: what each rank takes from a checkpoint written by a different
number of ranks, and the batch each rank trains.

A checkpoint holds the model and optimizer through ``torch.distributed.checkpoint`` (which
reshards them to any number of ranks) and one file of training state per rank. When the world
size changed since the save (:func:`resharded_rank_state`):

* what every rank holds alike (scheduler, data position, instability statistics, micro-batch size,
  extra state) comes from rank 0's file: the data position must be global, the same on every
  rank and independent of the world size (:class:`~trainguard.sampler.ResumableSampler` keeps that
  contract and says so with ``reshardable = True``; a sampler without it is refused, exit 2,
  before anything is loaded);
* each rank's random number generators are derived by a fixed rule, so that a resume is
  reproducible: rank ``r`` of the new world seeds Python, NumPy and torch with the first 8 bytes
  of ``SHA-256(rank 0's saved torch CPU generator state ‖ step ‖ r)`` (:func:`derived_seed`).

The global batch (``[elastic] keep``, :func:`rank_batch`): with ``"global_batch"`` (default) the
per-rank batch a script configured for the world size the run started with (``base_world_size``,
kept in the checkpoint) is scaled by ``base / current``, so the optimizer sees the same number
of samples per step and the learning-rate schedule still fits (``guard.run_step()`` splits a
batch that no longer fits in memory into micro-batches: gradient accumulation); with
``"rank_batch"`` each rank keeps its batch and the global batch changes with the world size: a
script that wants the usual linear scaling of the learning rate applies it itself.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from ..outcomes import BadInput
from .determinism import capture_rng, seed_everything


class ElasticState:
    """The world size the run started with (the per-rank batch a script configures is for it);
    saved in the checkpoint, a Stateful.

    Args:
        world_size: this launch's world size (the base of a fresh run).
    """

    def __init__(self, world_size: int):
        self.base_world_size = world_size

    def state_dict(self) -> dict[str, int]:
        return {"base_world_size": self.base_world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.base_world_size = int(state["base_world_size"])


def check_reshardable(sampler: Any, path: Path, saved: int, world_size: int) -> None:
    """Refuse to resume ``sampler`` on ``world_size`` ranks from the checkpoint ``path`` written by
    ``saved`` ranks unless its state is world-size independent (``reshardable = True``).

    Raises:
        BadInput: naming the checkpoint, both world sizes and the sampler's type.
    """
    if sampler is None or getattr(sampler, "reshardable", False):
        return
    raise BadInput(
        f"checkpoint {path} was written by {saved} ranks and this run has {world_size}: the sampler "
        f"{type(sampler).__name__} does not say its state is world-size independent (reshardable = True), "
        "so the data position cannot be carried over; resume on "
        f"{saved} ranks, or use trainguard.ResumableSampler (see docs/elastic.md)"
    )


def derived_seed(rank0_rng: dict[str, Any], step: int, rank: int) -> int:
    """The seed of rank ``rank`` after a world-size change at step ``step``: the first 8 bytes of
    SHA-256 over rank 0's saved torch CPU generator state, the step and the rank (see the module doc)."""
    h = hashlib.sha256(rank0_rng["torch"].numpy().tobytes())
    h.update(struct.pack("<qq", step, rank))
    return int.from_bytes(h.digest()[:8], "little")


def resharded_rank_state(rank0: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's training state after a world-size change: rank 0's saved state (``rank0``, with
    its ``step``) with the RNG streams derived for ``rank`` (:func:`derived_seed`)."""
    seed_everything(derived_seed(rank0["rng"], int(rank0["step"]), rank))
    return {**rank0, "rng": capture_rng()}


def rank_batch(batch: int, keep: str, base_world_size: int, world_size: int) -> int:
    """The batch one rank trains per step (see the module doc).

    Args:
        batch: the per-rank batch the script configures, meant for ``base_world_size`` ranks.
        keep: ``"global_batch"`` or ``"rank_batch"``.
    Raises:
        BadInput: ``global_batch`` and the global batch ``batch × base_world_size`` does not
            divide by ``world_size``.
    """
    if keep == "rank_batch" or world_size == base_world_size:
        return batch
    total = batch * base_world_size
    if total % world_size:
        raise BadInput(
            f'[elastic] keep = "global_batch": the global batch {total} ({batch} per rank on {base_world_size} '
            f'ranks) does not divide by {world_size} ranks; use a world size that divides it, or keep = "rank_batch"'
        )
    return total // world_size
