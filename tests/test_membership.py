"""The membership state machine (src/trainguard/launcher/membership.py), tested as a protocol: a
table per rule, the give-up rule, and hypothesis over random event sequences checking the
invariants. Pure: no process, no store, no clock."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.launcher.membership import (
    Admit,
    AdmitFailed,
    CheckpointFirst,
    Collect,
    Collected,
    End,
    Fallback,
    Finished,
    Followed,
    Forward,
    GiveUpRule,
    GroupStarted,
    GrowBack,
    Hang,
    Idle,
    Joined,
    KillSurvivors,
    Limits,
    Look,
    Machine,
    MembershipRestart,
    NodeLost,
    NodesWaiting,
    Progress,
    Replace,
    ReplaceNode,
    Restart,
    Settled,
    SettleTimedOut,
    Shrink,
    State,
    StopGraceExpired,
    StopRequested,
    TimedOut,
    decide,
    initial,
)

RUNNING = None


def group(n: int = 2, **limits) -> State:
    """A started group of ``n`` ranks on this node."""
    return initial(Limits(**limits), n, frozenset(range(n)))


ENDING = "the group was ending (a rank finished training): nothing to recover in place"


def run(state: State, *events) -> tuple[State, list]:
    """Feed ``events`` in order; the final state and every decision."""
    decided = []
    for e in events:
        state, d = decide(state, e)
        decided.extend(d)
    return state, decided


# ---- Look: a lost rank -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state,look,expected",
    [
        # replaced in-process
        (group(), Look({0: RUNNING, 1: -9}), [Replace((1,))]),
        (group(4), Look({0: RUNNING, 1: -9, 2: RUNNING, 3: 1}), [Replace((1, 3))]),
        # not in-process: kill the survivors, collect, restart (Collected)
        (group(in_process=False), Look({0: RUNNING, 1: -9}), [KillSurvivors(), Collect()]),
        # a rank exiting with a decision code: no replacement, collect now
        (group(), Look({0: 75, 1: -9}), [KillSurvivors(), Collect()]),
        (group(), Look({0: 75, 1: RUNNING}), [Collect()]),
        # why in-process recovery cannot take it
        (
            group(),
            Look({0: RUNNING, 1: -9}, declined="Lightning owns the process group"),
            [
                Fallback("in-process recovery does not apply: Lightning owns the process group"),
                KillSurvivors(),
                Collect(),
            ],
        ),
        (
            group(),
            Look({0: -9, 1: -9}),
            [Fallback("no rank survived to send the state"), KillSurvivors(), Collect()],
        ),
        (
            group(max_replacements=0),
            Look({0: RUNNING, 1: -9}),
            [Fallback("in-process replacement budget spent (0)"), KillSurvivors(), Collect()],
        ),
        # a rank that fails while the group ends (another finished, or tears down after the end):
        # no replacement (it would meet no one); the restart resumes from the final checkpoint
        (
            group(),
            Look({0: 0, 1: -6}),
            [Fallback(ENDING), KillSurvivors(), Collect()],
        ),
        (
            group(),
            Look({0: RUNNING, 1: -6}, ending=True),
            [Fallback(ENDING), KillSurvivors(), Collect()],
        ),
        # shrink: min_ranks allows it, one node, no spare ready
        (group(4, min_ranks=2), Look({0: RUNNING, 1: -9, 2: RUNNING, 3: RUNNING}), [Shrink((1,))]),
        (
            group(4, min_ranks=2),
            Look({0: RUNNING, 1: -9, 2: RUNNING, 3: RUNNING}, spares_ready=1),
            [Replace((1,))],
        ),
        (
            group(4, min_ranks=2),
            Look({0: RUNNING, 1: -9, 2: RUNNING, 3: RUNNING}, single_node=False),
            [Replace((1,))],
        ),
        (group(2, min_ranks=2), Look({0: RUNNING, 1: -9}), [Replace((1,))]),  # 1 left < min_ranks
        # healthy, or partly finished: nothing; every rank exited: collect
        (group(), Look({0: RUNNING, 1: RUNNING}), []),
        (group(), Look({0: 0, 1: RUNNING}), []),
        (group(), Look({0: 0, 1: 0}), [Collect()]),
    ],
)
def test_look_rules(state, look, expected):
    assert decide(state, look)[1] == tuple(expected)


def test_a_failure_while_a_generation_forms_falls_back_and_restarts():
    state, decided = run(group(), Look({0: RUNNING, 1: -9}))
    assert decided == [Replace((1,))] and state.forming == "replace" and state.replacements == 1
    state, decided = run(state, Look({0: -9, 1: RUNNING}))
    assert decided == [
        Fallback("a rank failed while the last (replace) generation was still forming", failed=True),
        KillSurvivors(),
        Collect(),
    ]
    state, decided = run(state, Collected({0: -9, 1: -9}))
    assert decided == [Restart("rank failure (exit codes {0: -9, 1: -9})")]
    assert state.forming is None and state.restarts == 1


def test_a_failure_beside_a_decision_code_while_a_generation_forms_abandons_it():
    """Found by the property test below (hypothesis): with a rank's replacement forming, another
    rank killed while a third exits with 75 killed the survivors without abandoning the forming
    generation (no ``recovery_fallback``)."""
    state, decided = run(group(3), Look({0: RUNNING, 1: RUNNING, 2: -9}))
    assert decided == [Replace((2,))]
    state, decided = run(state, Look({0: RUNNING, 1: -9, 2: 75}))
    assert decided == [
        Fallback("a rank failed while the last (replace) generation was still forming", failed=True),
        KillSurvivors(),
        Collect(),
    ]


def test_a_settled_recovery_lets_the_next_failure_be_replaced_and_the_budget_counts_ranks():
    state, decided = run(
        group(max_replacements=2), Look({0: RUNNING, 1: -9}), Joined(), Settled(), Look({0: -9, 1: RUNNING})
    )
    assert decided == [Replace((1,)), Replace((0,))] and state.replacements == 2
    state, decided = run(state, Joined(), Settled(), Look({0: RUNNING, 1: -9}))
    assert decided[0] == Fallback("in-process replacement budget spent (2)")


# ---- the progress rule: a recovery is done only when the group completed a step with it ---------

SETTLING = run(group(), Look({0: RUNNING, 1: -9}), Joined())[0]  # replaced and formed, no step yet
NOT_SETTLED = "a rank failed before the last (replace) recovery was done (a completed step)"


@pytest.mark.parametrize(
    "state,event,expected",
    [
        # a failure of a survivor or of the replacement before a completed step: the recovery failed
        (SETTLING, Look({0: -9, 1: RUNNING}), [Fallback(NOT_SETTLED, failed=True), KillSurvivors(), Collect()]),
        (SETTLING, Look({0: RUNNING, 1: 1}), [Fallback(NOT_SETTLED, failed=True), KillSurvivors(), Collect()]),
        # even with budget and spares left, and beside a requeue code
        (SETTLING, Look({0: 75, 1: -9}), [Fallback(NOT_SETTLED, failed=True), KillSurvivors(), Collect()]),
        # the bound passed without a completed step
        (
            SETTLING,
            SettleTimedOut("no step within 30 s"),
            [Fallback("no step within 30 s", failed=True), Restart("in-process recovery failed: no step within 30 s")],
        ),
        # a hang before the first step: no waiting for the killed rank's replacement
        (
            SETTLING,
            Hang("rank 1 silent"),
            [Fallback("a rank hung during the last (replace) recovery", failed=True), Restart("rank 1 silent")],
        ),
        # a lost node before the first step, with a spare node waiting
        (
            SETTLING,
            NodeLost("node 1 lost", 1, (1,), spare=True),
            [Fallback("node 1 lost during the last (replace) recovery", failed=True), Restart("node 1 lost")],
        ),
        # nothing grows back or joins in place before the first step
        (
            run(group(4, min_ranks=2, regrow=True), Look({0: RUNNING, 1: RUNNING, 2: -9, 3: RUNNING}), Joined())[0],
            Idle(1),
            [],
        ),
        (run(group(min_ranks=1), NodesWaiting(1), Joined())[0], NodesWaiting(1), []),
        # settled: the next failure is a new fault, replaced again
        (run(SETTLING, Settled())[0], Look({0: -9, 1: RUNNING}), [Replace((0,))]),
        # a late bound after settling, a restart or an end decides nothing
        (run(SETTLING, Settled())[0], SettleTimedOut("late"), []),
        # another node's agent published a generation: this node's failures restart until it settles
        (
            run(group(4), Followed(4))[0],
            Look({0: RUNNING, 1: -9}),
            [
                Fallback(
                    "a rank failed before the last (followed) recovery was done (a completed step)",
                    failed=True,
                ),
                KillSurvivors(),
                Collect(),
            ],
        ),
        (run(group(4), Followed(4), Settled())[0], Look({0: RUNNING, 1: -9}), [Replace((1,))]),
        # settled at checkpoint 40, a hang before a newer one: the recovery's, a restart (not a replacement)
        (
            run(SETTLING, Settled(Progress(None, 40)))[0],
            Hang("rank 1 silent", progress=Progress(52, 40)),
            [
                Fallback(
                    "a rank hung after the last (replace) recovery, before a newer checkpoint "
                    "(the loop may run its collectives apart since)",
                    failed=True,
                ),
                Restart("rank 1 silent"),
            ],
        ),
        # ... and after a newer checkpoint: a new fault, its killed rank replaced at the next look
        (run(SETTLING, Settled(Progress(None, 40)))[0], Hang("rank 1 silent", progress=Progress(62, 60)), []),
        # ... a rank that dies before it: a new fault too (a death is no sign of a misaligned loop)
        (run(SETTLING, Settled(Progress(None, 40)))[0], Look({0: -9, 1: RUNNING}), [Replace((0,))]),
        # a new start of the group that settles leaves nothing unproven
        (run(group(), GroupStarted(2, frozenset({0, 1})), Settled())[0], Hang("h", progress=Progress(3, None)), []),
    ],
    ids=[
        "survivor-fails",
        "replacement-fails",
        "beside-a-decision-code",
        "bound-passed",
        "hang",
        "node-lost",
        "no-grow-back",
        "no-admit",
        "settled-then-replaced",
        "late-bound",
        "followed",
        "followed-settled",
        "hang-unproven",
        "hang-proven",
        "death-unproven",
        "hang-after-start",
    ],
)
def test_progress_rule(state, event, expected):
    assert decide(state, event)[1] == tuple(expected)


def test_a_failed_recovery_restarts_from_the_checkpoint_and_the_next_group_starts_clean():
    state, decided = run(SETTLING, Look({0: RUNNING, 1: -9}), Collected({0: -9, 1: -9}))
    assert decided[-1] == Restart("rank failure (exit codes {0: -9, 1: -9})")
    assert state.settling is None and state.forming is None and state.restarts == 1
    state, decided = run(state, GroupStarted(2, frozenset({0, 1})), Look({0: RUNNING, 1: -9}))
    assert decided == [  # before the new group's first step no rank holds a state to send
        Fallback("a rank failed before the group completed its first step (no rank holds a state to send yet)"),
        KillSurvivors(),
        Collect(),
    ]
    state, decided = run(state, Collected({0: -9, 1: -9}), GroupStarted(2, frozenset({0, 1})), Settled())
    assert run(state, Look({0: RUNNING, 1: -9}))[1] == [Replace((1,))]  # trained a step: in-process again


# ---- Collected, Finished, TimedOut, stops ------------------------------------------------------


@pytest.mark.parametrize(
    "state,event,expected",
    [
        (group(), Collected({1: -9}), [Restart("rank failure (exit codes {1: -9})")]),
        (group(), Collected({0: 75, 1: 75}), [End(75, "ranks stopped for requeue")]),
        (group(), Collected({0: 2}), [End(2, "bad input")]),
        (group(), Collected({0: 76, 1: -9}), [End(76, "a rank gave up")]),
        (
            group(),
            Collected({0: 1}, script_error=(1, "the script failed")),
            [End(1, "the script failed", "script_error")],
        ),
        (
            group(max_restarts=0),
            Collected({1: -9}),
            [End(76, "restart budget (0) spent: rank failure (exit codes {1: -9})", "restart_budget_spent")],
        ),
        (group(), Finished(), [End(0, "finished")]),
        (
            group(),
            TimedOut("generation 1 did not form within 65 s"),
            [
                Fallback("generation 1 did not form within 65 s", failed=True),
                Restart("in-process recovery failed: generation 1 did not form within 65 s"),
            ],
        ),
        (group(), StopRequested("SIGTERM"), [Forward("SIGTERM")]),
        (group(), StopGraceExpired(), [End(75, "stop grace expired", "stop_grace_expired")]),
    ],
)
def test_collected_and_ending_rules(state, event, expected):
    assert decide(state, event)[1] == tuple(expected)


def test_after_a_stop_a_failure_ends_with_75_and_nothing_is_decided_after_an_end():
    state, decided = run(group(), StopRequested("SIGTERM"), Look({0: RUNNING, 1: -9}))
    assert decided == [Forward("SIGTERM"), KillSurvivors(), Collect()]  # no replacement during a stop
    state, decided = run(state, Collected({0: -9, 1: -9}))
    assert decided == [End(75, "ranks stopped for requeue")]
    assert run(state, Look({0: -9, 1: -9}), Finished(), Hang("x"))[1] == []


# ---- hangs -------------------------------------------------------------------------------------


def test_a_hang_waits_for_the_killed_ranks_exit_unless_unkillable_or_not_in_process():
    assert decide(group(), Hang("hang: rank 1 silent"))[1] == ()
    assert decide(group(), Hang("hang: rank 1 silent", unkillable=True))[1] == (Restart("hang: rank 1 silent"),)
    assert decide(group(in_process=False), Hang("h"))[1] == (Restart("h"),)
    forming = run(group(), Look({0: RUNNING, 1: -9}))[0]
    assert decide(forming, Hang("h"))[1] == (
        Fallback("a rank hung during the last (replace) recovery", failed=True),
        Restart("h"),
    )


# ---- nodes, shrink and grow back ---------------------------------------------------------------


def test_waiting_nodes_join_in_place_with_min_ranks_else_through_a_checkpoint():
    state, decided = run(group(), NodesWaiting(1), NodesWaiting(1))
    assert decided == [CheckpointFirst(1)] and state.regrowing  # once: the ranks are stopping
    state, decided = run(state, Collected({0: 75, 1: 75}))
    assert decided == [MembershipRestart()] and not state.regrowing and state.restarts == 0
    state, decided = run(group(min_ranks=1), NodesWaiting(2), NodesWaiting(2))
    assert decided == [Admit(2)] and state.forming == "admit"
    assert run(group(min_ranks=1), NodesWaiting(1, abandoned=True))[1] == [
        Restart("the group restarted on another node")
    ]
    state, decided = run(group(min_ranks=1), NodesWaiting(1), AdmitFailed("rendezvous failed"))
    assert decided == [Admit(1), Restart("rendezvous failed")]
    assert run(group(min_ranks=1), StopRequested("SIGTERM"), NodesWaiting(1))[1] == [Forward("SIGTERM")]


def test_a_shrunk_group_grows_back_when_a_spare_is_ready_within_the_budget():
    state, decided = run(group(4, min_ranks=2, regrow=True), Look({0: RUNNING, 1: RUNNING, 2: -9, 3: -9}))
    assert decided == [Shrink((2, 3))] and state.world_size == 2 and state.withdrawn == {2, 3}
    assert run(state, Idle(1))[1] == []  # the shrink is still forming
    assert run(state, Joined(), Idle(1))[1] == []  # formed, no step completed yet (the progress rule)
    state, decided = run(state, Joined(), Settled(), Idle(0), Idle(1))
    assert decided == [GrowBack((2,))] and state.world_size == 3 and state.withdrawn == {3}
    state, decided = run(state, Joined(), Settled(), Idle(5))
    assert decided == [GrowBack((3,))] and state.world_size == 4 and not state.withdrawn
    no_regrow = (Look({0: RUNNING, 1: RUNNING, 2: -9, 3: RUNNING}), Joined(), Settled(), Idle(1))
    assert run(group(4, min_ranks=2), *no_regrow)[1] == [Shrink((2,))]  # no regrow: stays smaller


@pytest.mark.parametrize(
    "state, event, expected",
    [
        (group(4), NodeLost("lost", 1, (2, 3), spare=True), [ReplaceNode(1, (2, 3))]),
        (group(4), NodeLost("lost", 1, (2, 3), spare=False), [Restart("lost")]),
        (group(4, in_process=False), NodeLost("lost", 1, (2, 3), spare=True), [Restart("lost")]),
        (group(4, max_replacements=1), NodeLost("lost", 1, (2, 3), spare=True), [Restart("lost")]),
        (
            run(group(4), Look({0: RUNNING, 1: -9}))[0],
            NodeLost("lost", 1, (2, 3), spare=True),
            [Fallback("lost during the last (replace) recovery", failed=True), Restart("lost")],
        ),
        (run(group(4), StopRequested("SIGTERM"))[0], NodeLost("lost", 1, (2, 3), spare=True), [Restart("lost")]),
        (
            group(4, max_restarts=0),
            NodeLost("lost", 1, (2, 3)),
            [End(76, "restart budget (0) spent: lost", "restart_budget_spent")],
        ),
    ],
    ids=["spare-node", "no-spare", "not-in-process", "budget", "forming", "stopping", "no-restart-left"],
)
def test_node_lost_rules(state, event, expected):
    assert decide(state, event)[1] == tuple(expected)


def test_a_replaced_node_forms_then_the_next_loss_is_taken_too():
    state, decided = run(group(4), NodeLost("lost", 1, (2, 3), spare=True))
    assert decided == [ReplaceNode(1, (2, 3))] and state.forming == "replace" and state.replacements == 2
    assert run(state, NodeLost("again", 1, (2, 3), spare=True))[1] == [
        Fallback("again during the last (replace) recovery", failed=True),
        Restart("again"),
    ]  # still forming
    state, decided = run(state, Joined(), Settled(), NodeLost("again", 1, (2, 3), spare=True))
    assert decided == [ReplaceNode(1, (2, 3))] and state.replacements == 4


def test_followed_and_group_started_set_the_membership():
    state, _ = run(group(4), Followed(3))
    assert state.world_size == 3
    state, _ = run(state, Look({0: RUNNING, 1: -9}), GroupStarted(8, frozenset({0, 1, 2, 3})))
    assert state.world_size == 8 and state.forming is None and state.local == {0, 1, 2, 3}


def test_an_unknown_event_is_refused():
    with pytest.raises(TypeError, match="not a membership event"):
        decide(group(), object())


# ---- the give-up rule (was RestartPolicy) -------------------------------------------------------


class Rule:
    def __init__(self, max_no_progress: int, max_same_step: int, initial_ckpt: Optional[int]):
        self.rule = GiveUpRule(True, max_no_progress, max_same_step, last_ckpt=initial_ckpt)

    def give_up_reason(self, step: Optional[int], ckpt: Optional[int]) -> Optional[str]:
        self.rule, why = self.rule.after(Progress(step, ckpt))
        return why


def test_same_step_rule():
    policy = Rule(max_no_progress=10, max_same_step=2, initial_ckpt=None)
    assert policy.give_up_reason(15, 10) is None
    why = policy.give_up_reason(15, 10)
    assert why is not None and "step 15" in why


def test_same_step_rule_needs_consecutive_failures_at_that_step():
    policy = Rule(max_no_progress=10, max_same_step=3, initial_ckpt=None)
    for step, ckpt in [(15, 10), (15, 10), (30, 20), (15, 10), (15, 10)]:
        assert policy.give_up_reason(step, ckpt) is None, step
    assert "step 15" in policy.give_up_reason(15, 10)
    unknown = Rule(max_no_progress=10, max_same_step=2, initial_ckpt=None)
    assert unknown.give_up_reason(None, None) is None and unknown.give_up_reason(None, None) is None


def test_no_progress_rule():
    policy = Rule(max_no_progress=3, max_same_step=2, initial_ckpt=10)
    assert policy.give_up_reason(12, 10) is None
    assert policy.give_up_reason(14, 10) is None
    why = policy.give_up_reason(16, 10)
    assert why is not None and "3 consecutive failures without checkpoint progress" in why and "step 10" in why


def test_checkpoint_progress_resets_the_no_progress_count():
    policy = Rule(max_no_progress=2, max_same_step=2, initial_ckpt=None)
    assert policy.give_up_reason(5, None) is None  # no checkpoint yet, none at launch: no progress (1)
    assert policy.give_up_reason(25, 20) is None  # progress: reset
    assert policy.give_up_reason(27, 20) is None  # 1
    assert policy.give_up_reason(45, 40) is None  # reset
    assert policy.give_up_reason(47, 40) is None  # 1
    why = policy.give_up_reason(49, 40)  # 2
    assert why is not None and "2 consecutive failures without checkpoint progress" in why


def test_the_give_up_rule_ends_a_restart_and_is_counted_only_at_restarts():
    rule = GiveUpRule(True, max_no_progress=10, max_same_step=2)
    state = initial(Limits(in_process=False), 2, frozenset({0, 1}), rule)
    state, decided = run(state, Hang("h", progress=Progress(15, 10)), NodesWaiting(0), Idle(0))
    assert decided == [Restart("h")]
    state, decided = run(state, Collected({1: -9}, progress=Progress(15, 10)))
    assert decided[0].kind == "give_up" and decided[0].cause.startswith("the fault recurs at step 15")


# ---- properties over random event sequences ----------------------------------------------------

CODES = st.sampled_from([None, None, None, 0, -9, 1, 75])


def looks(n: int):
    return st.builds(
        Look,
        st.fixed_dictionaries({r: CODES for r in range(n)}),
        st.one_of(st.none(), st.just("declined")),
        st.integers(0, 2),
        st.booleans(),
        st.booleans(),
    )


def events(n: int):
    progress = st.builds(Progress, st.one_of(st.none(), st.integers(0, 5)), st.one_of(st.none(), st.integers(0, 3)))
    return st.one_of(
        looks(n),
        looks(n),
        st.builds(Collected, st.fixed_dictionaries({0: st.sampled_from([-9, 1, 75, 2])}), st.none(), progress),
        st.just(Finished()),
        st.just(Joined()),
        st.builds(Settled, progress),
        st.builds(TimedOut, st.just("did not form"), progress),
        st.builds(SettleTimedOut, st.just("no step"), progress),
        st.builds(Hang, st.just("hang"), st.booleans(), progress),
        st.just(StopRequested("SIGTERM")),
        st.just(StopGraceExpired()),
        st.builds(NodesWaiting, st.integers(0, 2), st.booleans(), progress),
        st.builds(AdmitFailed, st.just("rendezvous failed"), progress),
        st.builds(Idle, st.integers(0, 3)),
        st.builds(Followed, st.integers(1, n)),
        st.builds(NodeLost, st.just("node 1 lost"), st.integers(1, 3), st.just((2, 3)), st.booleans(), progress),
    )


@st.composite
def scenario(draw):
    n = draw(st.integers(2, 6))
    limits = Limits(
        in_process=draw(st.booleans()),
        max_replacements=draw(st.integers(0, 4)),
        max_restarts=draw(st.integers(0, 3)),
        min_ranks=draw(st.integers(0, n)),
        regrow=draw(st.booleans()),
    )
    rule = GiveUpRule(draw(st.booleans()), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    return initial(limits, n, frozenset(range(n)), rule), draw(st.lists(events(n), max_size=60))


MEMBERSHIP_CHANGES = (Replace, ReplaceNode, Shrink, GrowBack, Admit)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_invariants_hold_over_random_event_sequences(case):
    """At most one generation forms at a time; survivors are never killed while their replacement
    forms (unless the same decision abandons it); a lost rank always gets a decision; the
    replacement and restart budgets are never exceeded; after an end nothing is decided; a restart
    or an end always comes with the state's forming generation cleared."""
    state, sequence = case
    machine = Machine(state)
    for event in sequence:
        before = machine.state
        decided = machine.feed(event)
        after = machine.state
        changes = [d for d in decided if isinstance(d, MEMBERSHIP_CHANGES)]
        assert len(changes) <= 1
        if changes:
            assert before.forming is None, (event, before)  # one live generation at a time
            assert after.forming is not None
        if any(isinstance(d, KillSurvivors) for d in decided) and before.forming is not None:
            assert any(isinstance(d, Fallback) for d in decided)  # the forming generation is abandoned
        if isinstance(event, Look) and before.ended is None:
            lost = [r for r, c in event.codes.items() if c not in (None, 0, 75, 2, 76) and r not in before.withdrawn]
            if lost:  # every lost rank is replaced, shrunk, or left to the group restart path
                assert changes or any(isinstance(d, (KillSurvivors, Collect)) for d in decided)
        assert after.replacements <= after.limits.max_replacements
        assert after.restarts <= after.limits.max_restarts
        if before.ended is not None:
            assert decided == ()
        if any(isinstance(d, (Restart, End, MembershipRestart)) for d in decided):
            assert after.forming is None and after.settling is None
            assert after.unproven is None
        assert after.world_size >= 0 and not (after.local & after.withdrawn)
        if isinstance(event, Hang) and before.ended is None and before.unproven is not None:
            then, now = before.unproven[1], event.progress.newest_ckpt
            if now is None or (then is not None and now <= then):  # no newer checkpoint: the recovery's hang
                assert any(isinstance(d, (Restart, End)) for d in decided), (event, before, decided)


FAILURES = (Look, Hang, NodeLost, TimedOut, SettleTimedOut)


def _is_failure(event, state: State) -> bool:
    """A failure the progress rule speaks of: a lost rank, a hang, a lost node, a bound passed."""
    if isinstance(event, Look):
        return any(c not in (None, 0, 75, 2, 76) and r not in state.withdrawn for r, c in event.codes.items())
    if isinstance(event, SettleTimedOut):  # the agent sees it only while a formed generation settles
        return state.settling is not None
    return isinstance(event, FAILURES[1:])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_progress_rule_holds_over_random_event_sequences(case):
    """The progress rule (DESIGN.md invariant 10): between two completed steps (``Settled``, or a
    new start of the group) there is at most one recovery in place; a failure after one and before
    a completed step never leads to another, and always ends the group (its survivors killed and
    collected, a restart, or the end of the launch) with the recovery said to have failed."""
    state, sequence = case
    machine = Machine(state)
    open_recovery = False  # a membership change was decided and no step completed since
    for event in sequence:
        before = machine.state
        decided = machine.feed(event)
        changes = [d for d in decided if isinstance(d, MEMBERSHIP_CHANGES)]
        if isinstance(event, (Settled, GroupStarted)):
            open_recovery = False
        if changes:
            assert not open_recovery, (event, before)  # at most one between two completed steps
            open_recovery = True
            continue
        if open_recovery and before.ended is None and _is_failure(event, before) and before.recovering:
            ends_group = (KillSurvivors, Collect, Restart, End)
            assert any(isinstance(d, ends_group) for d in decided), (event, before, decided)
            assert (
                any(isinstance(d, Fallback) and d.failed for d in decided)
                or before.stop is not None
                or any(isinstance(d, End) for d in decided)
            ), (event, before, decided)
        if any(isinstance(d, (Restart, End, MembershipRestart)) for d in decided):
            open_recovery = False


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.lists(st.tuples(st.integers(0, 7), st.booleans()), min_size=1, max_size=40))
def test_no_sequence_of_recoveries_repeats_without_a_completed_step(n, faults):
    """Progress: a rank fails in every poll and the group completes a step after a recovery only
    when the draw says so; every replacement is followed by a completed step before the next one,
    and the launch ends (76) within the restart budget however the draws fall."""
    limits = Limits(max_replacements=100, max_restarts=3)
    machine = Machine(initial(limits, n, frozenset(range(n))))
    steps_since_replace = None  # completed-step rounds since the last Replace (None: none pending)
    for victim, completes in faults:
        codes = {r: (-9 if r == victim % n else None) for r in range(n)}
        decided = machine.feed(Look(codes))
        if any(isinstance(d, Replace) for d in decided):
            assert steps_since_replace in (None, 1), "a second replacement before a completed step"
            steps_since_replace = 0
            machine.feed(Joined())
            if completes:
                machine.feed(Settled())
                steps_since_replace = 1
        if any(isinstance(d, Collect) for d in decided):
            machine.feed(Collected({victim % n: -9}))
            machine.feed(GroupStarted(n, frozenset(range(n))))
            steps_since_replace = None
        if machine.state.ended is not None:
            break
    restarts = sum(isinstance(d, Restart) for d in machine.decided)
    assert restarts <= limits.max_restarts


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.lists(st.integers(0, 7), min_size=1, max_size=40))
def test_repeated_failures_always_end_within_the_budgets(n, victims):
    """Lose a rank in every poll: each is replaced (and joined) or restarts the group, and the
    launch ends (76) within max_replacements + max_restarts + 1 failures: no loop without progress."""
    limits = Limits(max_replacements=3, max_restarts=2)
    machine = Machine(initial(limits, n, frozenset(range(n))))
    failures = 0
    for v in victims:
        codes = {r: (-9 if r == v % n else None) for r in range(n)}
        decided = machine.feed(Look(codes))
        if any(isinstance(d, Collect) for d in decided):
            machine.feed(Collected({v % n: -9}))
        machine.feed(Joined())
        failures += 1
        if machine.state.ended is not None:
            break
    if failures > limits.max_replacements + limits.max_restarts:
        assert machine.state.ended is not None and machine.state.ended[0] == 76
    assert sum(isinstance(d, Replace) for d in machine.decided) <= limits.max_replacements
    assert sum(isinstance(d, Restart) for d in machine.decided) <= limits.max_restarts
