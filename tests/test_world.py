"""The Guard's one shared view of rank and world size (src/trainguard/guard/world.py, src/trainguard/ranks.py):
a shrink or a growth in place changes one object, and every part built on it reads the new rank,
world size and hosts at its next use; the parts that hold something sized for the old group drop it
(``group_resized``). Nothing is copied into the parts, so nothing has to be pushed to them."""

from __future__ import annotations

import pytest
import torch

from trainguard.checkpoint.checkpointer import Checkpointer, ResumePoint
from trainguard.events import EventLog
from trainguard.faults import FaultInjector
from trainguard.guard.stop_check import StopCheck
from trainguard.guard.world import Renumber, World
from trainguard.health.straggler import StragglerDetector
from trainguard.instability.detect import Detector
from trainguard.instability.fold import LossFold
from trainguard.ranks import Ranks
from trainguard.sdc.replicas import ReplicaCheck
from trainguard.sections import CheckpointSection, InstabilitySection, SDCSection, StopSection, StragglerSection
from trainguard.stop.conditions import StopConditions
from trainguard.stop.signals import ShutdownHandler


def test_a_shrink_changes_the_world_once_and_every_part_built_on_it_reads_the_new_rank_and_size(tmp_path):
    """Rank 2 of 3 on hosts a, b, c. Rank 0 leaves (rank 2 becomes rank 1 of 2 on b, c), then
    rank 1 leaves (it becomes rank 0 of 1): each part answers for the rank and size of the moment."""
    world = World(2, 3)
    world.hosts = ["a", "b", "c"]
    events = EventLog(tmp_path, 2)
    fold = LossFold(world)
    sdc = ReplicaCheck(SDCSection(check_interval=5), torch.nn.Linear(2, 2), world, events)
    straggler = StragglerDetector(StragglerSection(), world, events, tmp_path)
    ckpt = Checkpointer(CheckpointSection(async_save=False), tmp_path, events, torch.nn.Linear(2, 2), None, world)
    stop = StopConditions(StopSection(), tmp_path, ShutdownHandler(["SIGUSR1"], 300.0), None)
    faults = FaultInjector([], 2, 3, 0, events)
    check = StopCheck(stop, ckpt, straggler, fold, faults, lambda: 7, world)  # generation 7 may grow in place
    detector = Detector(InstabilitySection(), world)
    renumber = Renumber(world, events, (fold, sdc, straggler), None)
    try:
        assert fold.size == 8 * 3 + 11 and sdc.active and straggler.active
        assert check.local_flags(1).grow == 0  # only rank 0 proposes a growth

        renumber(1, 2, ["b", "c"])
        assert (world.rank, world.world_size) == (1, 2)
        assert fold.size == 8 * 2 + 11  # laid out again for 2 ranks
        assert fold.extra(4, torch.zeros(4)).numel() == fold.size
        assert straggler.hosts_of([1]) == ["c"] and sdc.active
        assert ckpt.written_by(ResumePoint("local", 5)) == 2
        assert check.local_flags(2).grow == 0

        renumber(0, 1, ["c"])
        assert fold.size == 8 + 11
        assert not sdc.active and not straggler.active  # one rank: no replica, no peer to compare with
        assert check.local_flags(3).grow == 7  # rank 0 now: it proposes the growth
        verdict = detector.observe(3, torch.tensor(2.5), torch.tensor(0.5))  # world size 1: no collective
        assert verdict.loss == 2.5 and verdict.grad_norm == 0.5
    finally:
        ckpt.close()
        events.close()


def test_a_part_made_on_its_own_takes_fixed_ranks_and_refuses_a_rank_outside_the_group():
    ranks = Ranks(1, 2, ["x", "y"])
    assert (ranks.rank, ranks.world_size, ranks.hosts) == (1, 2, ["x", "y"])
    assert Ranks(0, 1).hosts == []
    for rank, world_size in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match=f"rank {rank} of world size {world_size}"):
            Ranks(rank, world_size)
