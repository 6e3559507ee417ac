"""Shrink in place: the group goes on without a lost rank, as a smaller group.

With ``[elastic] min_ranks`` set (one node, in-process recovery on), a rank lost while no warm
spare is ready is not started again cold (seconds during which every rank waits). Instead:

1. **The launcher publishes a generation with ``left``** (:meth:`~trainguard.launcher.replace.Replacer.shrink`):
   the lost global ranks, the smaller world size, a fresh store. It puts a finished process in
   the lost worker's slot (torch counts it as done) and gives the other workers their new numbers.
2. **The survivors renumber** (:func:`~trainguard.rejoin.protocol.new_rank`: the order is kept and
   the gaps close, ranks 0, 2 of 3 become 0, 1), set ``RANK``/``WORLD_SIZE``, and tell every
   component that holds a rank or a world size (checkpointer, instability detector, SDC check,
   straggler detector, OOM splitter, events, boundary file). The sampler goes on from the global
   data position on the new world size (:func:`reshard`), so every sample of the epoch is still
   seen once.
3. **They meet in the new generation** as in a replacement (:mod:`.regroup`): new default group,
   DDP's reducer rebuilt on it (gradients are now averaged over the smaller group), trainguard's
   own groups again. The interrupted step is done again from the step boundary, now split over
   fewer ranks: no completed step is lost.
4. **The global batch**: ``guard.rank_batch(batch)`` follows ``[elastic] keep``: with
   ``"global_batch"`` each rank now trains ``batch × base world size / new world size`` samples
   (the optimizer sees the same global batch; the micro-batch splitter takes over if it no longer
   fits in memory); with ``"rank_batch"`` the global batch shrinks with the group.

Each survivor writes ``world_size_changed`` (``in_process: true``, ``left``) and says it joined the
generation; the launcher counts the recovery finished when all have. The result is not bitwise
identical to a run without the loss (the summation order and the batch split change). A later
group restart starts the whole launched world again and resumes on it from a checkpoint.

**Growing back** (``[elastic] regrow``): the launcher starts a spare for each rank that left; once
one is ready it publishes a generation with :attr:`~.protocol.Generation.grown` (the newcomers
numbered after the others). Rank 0 finds it at its next stop check and the check's all-reduce
tells every rank, so all of them, at the same step boundary, take the larger world size, meet
the newcomers in a new group and send them the model, optimizer and shared state; a newcomer
derives its own data position and RNG streams from the lowest surviving rank's by the rule of a
resume on another world size (:func:`~trainguard.state.reshard.resharded_rank_state`). Nothing is redone.

**A node that arrives** (``--nnodes MIN:MAX``) grows the group the same way, with the newcomers
started by its own launcher (:mod:`trainguard.launcher.node_join`).

Not covered: shrinking on several nodes (a lost rank there is replaced instead), the node-local
checkpoint tier (its files are placed by rank), and a sampler without :func:`reshard` support
(refused at start, exit 2).
"""

from __future__ import annotations

from typing import Any, Optional

from ..outcomes import BadInput


def min_ranks_error(min_ranks: int, world_size: int) -> Optional[str]:
    """Why ``[elastic] min_ranks`` does not fit a ``world_size`` group (larger than it), else ``None``."""
    if min_ranks <= world_size:
        return None
    return (
        f"elastic.min_ranks = {min_ranks} is larger than the world size {world_size}: expected at most "
        f"{world_size} (0: never shrink)"
    )


def check_shrinkable(min_ranks: int, world_size: int, sampler: Any, local_tier: bool) -> None:
    """Refuse, at start, a run that asks to shrink in place but cannot.

    Args:
        min_ranks: ``[elastic] min_ranks`` (0: off, nothing to check).
        world_size: the launched world size.
        sampler: the Guard's sampler (``None``: the script keeps no data position).
        local_tier: whether the node-local checkpoint tier is on.
    Raises:
        BadInput: ``min_ranks`` above the world size, a sampler without ``reshard(rank, world_size)``,
            or the local tier on.
    """
    if not min_ranks:
        return
    too_large = min_ranks_error(min_ranks, world_size)
    if too_large:
        raise BadInput(too_large)
    if sampler is not None and not callable(getattr(sampler, "reshard", None)):
        raise BadInput(
            f"elastic.min_ranks = {min_ranks}: the sampler {type(sampler).__name__} has no reshard(rank, world_size) "
            "method, so the group cannot go on with fewer ranks from the same data position; use "
            "trainguard.ResumableSampler, add one (see docs/elastic.md), or set elastic.min_ranks = 0"
        )
    if local_tier:
        raise BadInput(
            f"elastic.min_ranks = {min_ranks} with checkpoint.local.dir: the node-local tier places its files by "
            "rank, which a shrink renumbers; use one of the two"
        )


def reshard(sampler: Any, rank: int, world_size: int) -> None:
    """Make ``sampler`` go on as rank ``rank`` of ``world_size`` from its global position (its
    ``reshard`` method; :class:`~trainguard.sampler.ResumableSampler` has one). ``None``: nothing."""
    if sampler is not None:
        sampler.reshard(rank, world_size)
