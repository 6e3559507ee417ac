"""The sharded model's recovery decisions, in one process: who holds whose snapshot copy, the
newest snapshot every rank can roll back to (table and random sequences), which surviving
replica sends an HSDP shard, and when an HSDP recovery loses no step (survivors one step apart
included). End to end: tests/test_fsdp2.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.rejoin.sharded import ReplicaPlan, replica_plan, sources_from
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


HSDP = [[0, 2], [1, 3]]  # 2 replica groups (ranks 0, 1 and 2, 3) of 2 shards
PLANS = {
    # name: (sets, survivors' steps, takers, replacements' kept steps, expected)
    "a lost rank, the survivors at one step": (HSDP, {0: 13, 1: 13, 2: 13}, {0, 1, 2}, {3: {12, 13}}, (13, {3: 1}, ())),
    "a survivor behind takes the step from its replica": (
        HSDP,
        {0: 12, 1: 13, 2: 13},
        {0, 1, 2},
        {3: {12, 13}},
        (13, {0: 2, 3: 1}, (0,)),
    ),
    "both replicas of a shard behind": (HSDP, {0: 12, 1: 13, 2: 12}, {0, 1, 2}, {3: {12, 13}}, None),
    "behind, its replica lost": (HSDP, {0: 13, 1: 12, 2: 13}, {0, 1, 2}, {3: {12, 13}}, None),
    "behind in a framework's loop (cannot skip its step)": (HSDP, {0: 12, 1: 13, 2: 13}, {1, 2}, {3: {13}}, None),
    "two steps apart": (HSDP, {0: 11, 1: 13, 2: 13}, {0, 1, 2}, {3: {12, 13}}, None),
    "the lost rank never kept the newest step": (HSDP, {0: 12, 1: 13, 2: 13}, {0, 1, 2}, {3: {12}}, None),
    "plain FSDP: no replica": (None, {0: 13}, {0}, {1: {13}}, None),
    "every rank lost": (HSDP, {}, set(), {0: {1}, 1: {1}, 2: {1}, 3: {1}}, None),
}


@pytest.mark.parametrize("name", PLANS)
def test_an_hsdp_recovery_loses_no_step_when_every_shard_of_the_newest_step_survives(name):
    sets, steps, takers, kept, expected = PLANS[name]
    plan = replica_plan(sets, steps, takers, kept)
    assert plan == (None if expected is None else ReplicaPlan(expected[0], expected[1], frozenset(expected[2])))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_replica_plan_ends_every_rank_at_the_newest_step_from_a_rank_that_holds_it(data):
    """Over random groups, losses and step boundaries: a plan ends at the newest survivor's step;
    every rank lacking that step (replaced or behind) gets its shard from a survivor at it that
    holds the same shard; no survivor at it receives anything; and no plan exactly when one of
    those cannot hold (more than a step apart, a shard with no replica at the step, a
    replacement without its boundary, a survivor behind that cannot take it)."""
    shards = data.draw(st.integers(1, 3))
    replicas = data.draw(st.integers(1, 3))
    world = shards * replicas
    sets = [[g * shards + i for g in range(replicas)] for i in range(shards)]
    lost = data.draw(st.sets(st.integers(0, world - 1), max_size=world))
    steps = {r: data.draw(st.integers(10, 12)) for r in range(world) if r not in lost}
    takers = {r for r in steps if data.draw(st.booleans())}
    kept = {r: data.draw(st.sets(st.integers(10, 12), max_size=2)) for r in lost}
    plan = replica_plan(sets, steps, takers, kept)
    if not steps:
        assert plan is None
        return
    top = max(steps.values())
    lacking = set(lost) | {r for r, s in steps.items() if s < top}
    holder = {r: next(s for s in sets if r in s) for r in range(world)}
    feasible = (
        min(steps.values()) >= top - 1
        and all(r in takers for r, s in steps.items() if s < top)
        and all(top in k for k in kept.values())
        and all(any(p not in lacking for p in holder[r]) for r in lacking)
    )
    assert (plan is not None) == feasible
    if plan is not None:
        assert plan.step == top and set(plan.sources) == lacking
        assert plan.behind == frozenset(r for r, s in steps.items() if s < top)
        for r, src in plan.sources.items():
            assert steps.get(src) == top and src in holder[r] and src not in lacking
