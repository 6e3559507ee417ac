"""The sharded model's recovery decisions, in one process: who holds whose snapshot copy, the
newest snapshot every rank can roll back to (table and random sequences), and which surviving
replica sends an HSDP shard. End to end: tests/test_fsdp2.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.rejoin.sharded import sources_from
from trainguard.rejoin.shards import holder_of, newest_common


@pytest.mark.parametrize(
    ("rank", "world", "local", "holder"),
    [
        (0, 4, 2, 2),  # two nodes of two: the same local rank on the next node
        (3, 4, 2, 1),  # wrapping around
        (0, 2, 2, 1),  # one node: the next rank
        (1, 2, 2, 0),
        (2, 4, 1, 3),  # four nodes of one rank
        (5, 6, 2, 1),
    ],
)
def test_a_snapshot_copy_goes_one_node_further_on(rank, world, local, holder):
    assert holder_of(rank, world, local) == holder


CASES = {
    # name: (own, held, lost, holder, expected)
    "the newest of both": ({0: {10, 15}}, {0: {1: {10, 15}}}, {1}, {1: 0}, 15),
    "the newest copy still on its way": ({0: {10, 15}}, {0: {1: {10}}}, {1}, {1: 0}, 10),
    "a survivor one snapshot behind": ({0: {10, 15}, 2: {5, 10}}, {0: {1: {10, 15}}, 2: {3: {5, 10}}}, {1}, {1: 0}, 10),
    "the holder lost too": ({0: {10}}, {0: {3: {10}}}, {1, 2}, {1: 2, 2: 0}, None),
    "no copy in common": ({0: {15}}, {0: {1: {10}}}, {1}, {1: 0}, None),
    "nothing lost (a regroup)": ({0: {10, 15}, 1: {10, 15}}, {}, set(), {}, 15),
    "no survivor": ({}, {}, {0, 1}, {0: 1, 1: 0}, None),
}


@pytest.mark.parametrize("name", CASES)
def test_newest_common_snapshot(name):
    own, held, lost, holder, expected = CASES[name]
    assert newest_common(own, held, lost, holder) == expected


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_chosen_snapshot_is_held_by_every_survivor_and_every_lost_ranks_holder(data):
    """Over random holdings: whatever is chosen, every survivor holds its own snapshot of that step
    and every lost rank's holder (itself a survivor) holds the copy; no newer step has both; and
    ``None`` only when no step has both."""
    world = data.draw(st.integers(2, 6))
    local = data.draw(st.sampled_from([w for w in (1, 2, 3) if world % w == 0]))
    steps = st.sets(st.sampled_from([0, 5, 10, 15, 20]), max_size=2)
    lost = data.draw(st.sets(st.integers(0, world - 1), max_size=world))
    holder = {r: holder_of(r, world, local) for r in range(world)}
    own = {r: data.draw(steps) for r in range(world) if r not in lost}
    held = {h: {next(r for r in range(world) if holder[r] == h): data.draw(steps)} for h in own}
    chosen = newest_common(own, held, lost, holder)

    def fits(step: int) -> bool:
        survivors_hold = own and all(step in s for s in own.values())
        copies = all(holder[r] not in lost and step in held[holder[r]].get(r, set()) for r in lost)
        return bool(survivors_hold and copies)

    candidates = [s for s in (0, 5, 10, 15, 20) if fits(s)]
    assert chosen == (max(candidates) if candidates else None)


@pytest.mark.parametrize(
    ("sets", "lost", "expected"),
    [
        ([[0, 2], [1, 3]], {3}, {3: 1}),  # 2 replica groups of 2 shards: rank 3's shard is rank 1's
        ([[0, 2], [1, 3]], {0, 1}, {0: 2, 1: 3}),  # the node of replica group 0 (ranks 0, 1): group 1 holds both
        ([[0, 2], [1, 3]], {1, 3}, None),  # both replicas of shard 1
        ([[0, 2, 4], [1, 3, 5]], {0, 2}, {0: 4, 2: 4}),
    ],
)
def test_an_hsdp_shard_comes_from_its_lowest_surviving_replica(sets, lost, expected):
    assert sources_from(sets, lost) == expected
