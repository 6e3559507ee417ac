"""Who is in a node's worker group, and what its launcher does about a change: one pure state machine.

:func:`decide` takes the agent's :class:`State` and one event (what the agent saw: its workers'
exit codes, a hang, a generation that formed or did not, nodes waiting to join, a stop signal) and
returns the new state and the decisions (replace these ranks, shrink, grow back, admit the
waiting nodes, restart the group, end the launch with a code, wait). It reads no clock, touches
no file, store, process or signal: the agent (:mod:`.agent`) gathers the facts into events and
carries the decisions out. Every membership rule lives here once:

===================  ==========================================================================
event                decisions (first rule that applies)
===================  ==========================================================================
``Look``             a rank failed, in-process recovery on, no stop, no decision code, and
                     ``can_replace`` → **Shrink** (one node, ``min_ranks`` allows it, no spare
                     ready) or **Replace** (not while the group ends: a rank finished); a failure in-process recovery cannot take →
                     **Fallback** (why) + **KillSurvivors** + **Collect**; any other exit that is
                     not 0 → **KillSurvivors** (on a failure; with **Fallback** first while a
                     generation forms) + **Collect**; every rank exited →
                     **Collect**; else nothing. ``can_replace``: no generation forming or
                     settling (the progress rule), the replacement budget not spent, the ranks did
                     not decline (nor give up a recovery of this launch), a rank survives.
``Collected``        (torch's result of a failed group) 75 while regrowing → **MembershipRestart**;
                     a decision code or a stop → **End** (its code); a script error → **End**
                     (its code); else **Restart** or **End** 76 (budget, give-up rule).
``Finished``         → **End** 0.
``Joined``           the generation formed: nothing forms any more; the recovery *settles* until
                     the group completes a step with it.
``Settled``          every rank completed a step after the generation formed: the recovery is done,
                     and *unproven* until a checkpoint newer than the newest at this moment commits.
``TimedOut``         the generation did not form (or a rank gave it up) → **Fallback** +
                     **Restart** / **End** 76.
``SettleTimedOut``   no completed step within the bound after the generation formed, or a rank
                     gave the recovery up → **Fallback** + **Restart** / **End** 76.
``Hang``             in-process recovery can take it (nothing forming or settling, no unproven
                     recovery) and no rank is unkillable → nothing (the killed rank's exit is the
                     next ``Look``'s); else (**Fallback** while a recovery forms, settles or is
                     unproven) + **Restart** / **End** 76.
``StopRequested``    → **Forward** (the ranks save and exit with 75).
``StopGraceExpired`` → **End** 75.
``NodesWaiting``     not while regrowing; no in-place join (``min_ranks`` 0) →
                     **CheckpointFirst**; the start was abandoned elsewhere → **Restart**;
                     nothing forming and no stop → **Admit**.
``AdmitFailed``      → **Restart** / **End** 76.
``Idle``             ``regrow``, withdrawn slots, a ready spare, nothing forming, budget left,
                     no stop → **GrowBack**.
``NodeLost``         another node vanished: a spare node waits, in-process recovery on, nothing
                     forming, no stop, budget left → **ReplaceNode**; else **Restart** / **End** 76.
``Followed``         another node's agent changed the membership: the world size follows, and the
                     group settles (the progress rule holds on every node).
``GroupStarted``     a new start of the group: nothing forms, no slot withdrawn; it settles until
                     its first completed step (before it no rank holds a state to send: a
                     failure restarts the group).
===================  ==========================================================================

**The progress rule.** A recovery in place (**Replace**, **ReplaceNode**, **Shrink**, **GrowBack**,
**Admit**) counts as done only when the new group has completed a step (**Settled**, every rank
past ``step_end`` of a step after the generation formed). Until then a failure of any rank, a hang,
a lost node or the bound's expiry means the recovery failed: **Fallback** (``failed``) and the group
restarts from the newest checkpoint at once, never another replacement. So between two completed
steps there is at most one recovery in place, and a recovery that does not lead to a step costs
the group restart it replaced plus the bound at most.

**A hang after a recovery, before a newer checkpoint.** A loop that keeps counters of its own (a
batch index that decides when to all-reduce a logged loss) has them one step ahead on the survivors
after a step done again; a collective that only some ranks run then hangs some steps later, after
the recovery settled, and a replacement of the hung rank meets the same survivors with the same
counters: a hang again. So a hang before a checkpoint newer than the recovery's commits is taken as
the recovery's: **Fallback** (``failed``) and a group restart from that checkpoint, whose ranks all
compute their counters afresh. A rank that dies (a ``Look``) is still replaced: a death is not the
sign of a misaligned loop.

**Restart** spends one of ``max_restarts``; when none is left, or the give-up rule (the same step
failing again, no progress: :class:`GiveUpRule`, from the facts the event carries) says so, the decision is **End** 76 instead. After an **End** every event
decides nothing. Tested as a protocol in ``tests/test_membership.py`` (a table per rule, and
``hypothesis`` over random event sequences); ``benchmarks/membership_scale.py`` drives it at
4,096 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from .membership_types import (
    BAD_INPUT,
    DECISION_CODES,
    END_MEANINGS,
    GIVE_UP,
    REQUEUE,
    Admit,
    AdmitFailed,
    CheckpointFirst,
    Collect,
    Collected,
    Decision,
    Decisions,
    End,
    Event,
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
    failed,
)

__all__ = [  # the data is re-exported: the launcher and the tests import everything from here
    "Admit",
    "AdmitFailed",
    "BAD_INPUT",
    "CheckpointFirst",
    "Collect",
    "Collected",
    "DECISION_CODES",
    "Decision",
    "Decisions",
    "END_MEANINGS",
    "End",
    "Event",
    "Fallback",
    "Finished",
    "Followed",
    "Forward",
    "GIVE_UP",
    "GiveUpRule",
    "GroupStarted",
    "GrowBack",
    "Hang",
    "Idle",
    "Joined",
    "KillSurvivors",
    "Limits",
    "Look",
    "Machine",
    "MembershipRestart",
    "NodeLost",
    "NodesWaiting",
    "Progress",
    "REQUEUE",
    "Replace",
    "ReplaceNode",
    "Restart",
    "SettleTimedOut",
    "Settled",
    "Shrink",
    "State",
    "StopGraceExpired",
    "StopRequested",
    "TimedOut",
    "decide",
    "failed",
    "initial",
    "why_not_in_process",
]


# ---- rules -------------------------------------------------------------------------------------


def initial(limits: Limits, world_size: int, local: frozenset[int], give_up: GiveUpRule = GiveUpRule()) -> State:
    """The state at the launch's first start of the group (``give_up``: the rule, its
    ``last_ckpt`` the newest checkpoint at launch)."""
    return State(limits, world_size, frozenset(local), give_up=give_up)


def decide(state: State, event: Event) -> tuple[State, Decisions]:
    """The new state and the decisions for ``event`` (see the module's table).

    Raises:
        TypeError: ``event`` is not one of this module's events.
    """
    if state.ended is not None:
        return state, ()
    rule = _RULES.get(type(event))
    if rule is None:
        raise TypeError(f"not a membership event: {event!r}")
    return rule(state, event)


def why_not_in_process(
    state: State, lost: list[int], codes: Mapping[int, Optional[int]], declined: Optional[str], ending: bool = False
):
    """Why in-process recovery cannot take the failure of the local ranks ``lost``, or ``None``."""
    if _in_recovery(state):
        return _failed_recovery(state)
    if ending or any(c == 0 for c in codes.values()):
        return "the group was ending (a rank finished training): nothing to recover in place"
    if state.replacements + len(lost) > state.limits.max_replacements:
        return f"in-process replacement budget spent ({state.limits.max_replacements})"
    if declined is not None:
        return f"in-process recovery does not apply: {declined}"
    if len(lost) == len(codes) == state.world_size:
        return "no rank survived to send the state"
    if state.settling == "start":
        return _failed_recovery(state)
    return None


def _failed_recovery(state: State) -> str:
    """Why a failure now cannot be recovered in place: the recovery under way failed (the progress
    rule), or the group has not completed a step since it started."""
    if state.forming is not None:
        return f"a rank failed while the last ({state.forming}) generation was still forming"
    if state.settling == "start":
        return "a rank failed before the group completed its first step (no rank holds a state to send yet)"
    return f"a rank failed before the last ({state.settling}) recovery was done (a completed step)"


def _in_recovery(state: State) -> bool:
    """A recovery in place is under way (forming, or settling after one; not a new start)."""
    return state.forming is not None or state.settling not in (None, "start")


def _look(state: State, event: Look) -> tuple[State, Decisions]:
    codes = {r: c for r, c in event.codes.items() if r not in state.withdrawn}
    lost = sorted(r for r, c in codes.items() if failed(c))
    decided: list[Decision] = []
    if lost and state.limits.in_process and state.stop is None and not any(c in DECISION_CODES for c in codes.values()):
        why = why_not_in_process(state, lost, codes, event.declined, event.ending)
        if why is None:
            shrinks = (
                event.single_node
                and state.limits.min_ranks > 0
                and event.spares_ready == 0
                and state.world_size - len(lost) >= state.limits.min_ranks
            )
            if shrinks:
                new = replace(
                    state,
                    forming="shrink",
                    world_size=state.world_size - len(lost),
                    local=state.local - set(lost),
                    withdrawn=state.withdrawn | set(lost),
                )
                return new, (Shrink(tuple(lost)),)
            return replace(state, forming="replace", replacements=state.replacements + len(lost)), (
                Replace(tuple(lost)),
            )
        decided.append(Fallback(why, failed=_in_recovery(state)))
    if lost and _in_recovery(state) and not decided:  # a stop or a decision code: the recovery is abandoned
        decided.append(Fallback(_failed_recovery(state), failed=True))
    if lost:
        return state, (*decided, KillSurvivors(), Collect())
    if all(c is not None for c in codes.values()) or any(c not in (None, 0) for c in codes.values()):
        return state, (Collect(),)
    return state, ()


def _restart_or_end(state: State, reason: str, progress: Progress) -> tuple[State, Decisions]:
    """**Restart** (one spent), or **End** 76 when the give-up rule says so or the budget is spent."""
    rule, give_up = state.give_up.after(progress)
    state = replace(state, give_up=rule)
    if give_up is not None:
        return _end(state, GIVE_UP, f"{give_up}: {reason}", "give_up", give_up)
    if state.restarts_left <= 0:
        return _end(
            state, GIVE_UP, f"restart budget ({state.limits.max_restarts}) spent: {reason}", "restart_budget_spent"
        )
    new = replace(
        state,
        restarts=state.restarts + 1,
        forming=None,
        settling=None,
        regrowing=False,
        withdrawn=frozenset(),
        unproven=None,
    )
    return new, (Restart(reason),)


def _end(state: State, code: int, reason: str, kind: str = "", cause: str = "") -> tuple[State, Decisions]:
    ended = replace(state, ended=(code, reason), forming=None, settling=None, unproven=None)
    return ended, (End(code, reason, kind, cause),)


def _collected(state: State, event: Collected) -> tuple[State, Decisions]:
    codes = dict(event.codes)
    decision = next((c for c in DECISION_CODES if c in codes.values()), None)
    if state.regrowing and decision == REQUEUE and state.stop is None:
        new = replace(state, regrowing=False, forming=None, settling=None, withdrawn=frozenset(), unproven=None)
        return new, (MembershipRestart(),)
    if decision is not None or state.stop is not None:
        code = decision if decision is not None else REQUEUE
        return _end(state, code, END_MEANINGS[code])
    if event.script_error is not None:
        return _end(state, *event.script_error, "script_error")
    return _restart_or_end(state, f"rank failure (exit codes {codes})", event.progress)


def _finished(state: State, event: Finished) -> tuple[State, Decisions]:
    return _end(state, 0, "finished")


def _joined(state: State, event: Joined) -> tuple[State, Decisions]:
    return replace(state, forming=None, settling=state.forming or state.settling), ()


def _settled(state: State, event: Settled) -> tuple[State, Decisions]:
    if state.settling in (None, "start"):  # no recovery in place (a new start of the group)
        return replace(state, settling=None), ()
    return replace(state, settling=None, unproven=(state.settling, event.progress.newest_ckpt)), ()


def _unproven(state: State, progress: Progress) -> Optional[str]:
    """The kind of a settled recovery that no newer checkpoint has proven yet, or ``None``."""
    if state.unproven is None:
        return None
    kind, then = state.unproven
    now = progress.newest_ckpt
    return None if now is not None and (then is None or now > then) else kind


def _timed_out(state: State, event: TimedOut) -> tuple[State, Decisions]:
    new, decided = _restart_or_end(
        replace(state, forming=None), f"in-process recovery failed: {event.why}", event.progress
    )
    return new, (Fallback(event.why, failed=True), *decided)


def _settle_timed_out(state: State, event: SettleTimedOut) -> tuple[State, Decisions]:
    if state.settling is None:  # settled, restarted or ended meanwhile
        return state, ()
    new, decided = _restart_or_end(state, f"in-process recovery failed: {event.why}", event.progress)
    return new, (Fallback(event.why, failed=True), *decided)


def _hang(state: State, event: Hang) -> tuple[State, Decisions]:
    unproven = _unproven(state, event.progress)
    takes = state.limits.in_process and state.recovering is None and state.replacements < state.limits.max_replacements
    if takes and not event.unkillable and unproven is None:
        return state, ()  # the killed rank's exit code comes in a later Look: it is replaced then
    new, decided = _restart_or_end(state, event.reason, event.progress)
    if _in_recovery(state):
        return new, (Fallback(f"a rank hung during the last ({state.recovering}) recovery", failed=True), *decided)
    if unproven is not None:
        why = (
            f"a rank hung after the last ({unproven}) recovery, before a newer checkpoint "
            "(the loop may run its collectives apart since)"
        )
        return new, (Fallback(why, failed=True), *decided)
    return new, decided


def _stop(state: State, event: StopRequested) -> tuple[State, Decisions]:
    new = state if state.stop is not None else replace(state, stop=event.signal)
    return new, (Forward(event.signal),)


def _grace(state: State, event: StopGraceExpired) -> tuple[State, Decisions]:
    return _end(state, REQUEUE, "stop grace expired", "stop_grace_expired")


def _nodes(state: State, event: NodesWaiting) -> tuple[State, Decisions]:
    if state.regrowing or event.count <= 0:
        return state, ()
    if not (state.limits.in_process and state.limits.min_ranks > 0):
        return replace(state, regrowing=True), (CheckpointFirst(event.count),)
    if event.abandoned:
        return _restart_or_end(state, "the group restarted on another node", event.progress)
    if state.recovering is None and state.stop is None:
        return replace(state, forming="admit"), (Admit(event.count),)
    return state, ()


def _admit_failed(state: State, event: AdmitFailed) -> tuple[State, Decisions]:
    return _restart_or_end(replace(state, forming=None), event.why, event.progress)


def _idle(state: State, event: Idle) -> tuple[State, Decisions]:
    room = state.limits.max_replacements - state.replacements
    if (
        not state.limits.regrow
        or not state.withdrawn
        or state.stop is not None
        or state.regrowing
        or state.recovering is not None
    ):
        return state, ()
    slots = tuple(sorted(state.withdrawn)[: min(event.spares_ready, room)])
    if not slots:
        return state, ()
    new = replace(
        state,
        forming="grow",
        replacements=state.replacements + len(slots),
        world_size=state.world_size + len(slots),
        local=state.local | set(slots),
        withdrawn=state.withdrawn - set(slots),
    )
    return new, (GrowBack(slots),)


def _node_lost(state: State, event: NodeLost) -> tuple[State, Decisions]:
    takes = (
        event.spare
        and state.limits.in_process
        and state.recovering is None
        and state.stop is None
        and not state.regrowing
        and state.replacements + len(event.ranks) <= state.limits.max_replacements
    )
    if takes:
        new = replace(state, forming="replace", replacements=state.replacements + len(event.ranks))
        return new, (ReplaceNode(event.node, event.ranks),)
    new, decided = _restart_or_end(replace(state, forming=None), event.why, event.progress)
    if not _in_recovery(state):
        return new, decided
    return new, (Fallback(f"{event.why} during the last ({state.recovering}) recovery", failed=True), *decided)


def _followed(state: State, event: Followed) -> tuple[State, Decisions]:
    return replace(state, world_size=event.world_size, settling=state.settling or "followed"), ()


def _started(state: State, event: GroupStarted) -> tuple[State, Decisions]:
    new = replace(
        state,
        world_size=event.world_size,
        local=frozenset(event.local),
        withdrawn=frozenset(),
        forming=None,
        settling="start",
        regrowing=False,
        unproven=None,
    )
    return new, ()


_RULES = {
    Look: _look,
    Collected: _collected,
    Finished: _finished,
    Joined: _joined,
    Settled: _settled,
    TimedOut: _timed_out,
    SettleTimedOut: _settle_timed_out,
    Hang: _hang,
    StopRequested: _stop,
    StopGraceExpired: _grace,
    NodesWaiting: _nodes,
    AdmitFailed: _admit_failed,
    Idle: _idle,
    NodeLost: _node_lost,
    Followed: _followed,
    GroupStarted: _started,
}


@dataclass
class Machine:
    """The agent's holder of the state: feeds events, keeps the new state, returns the decisions
    (and counts them, for the tests and the scale benchmark)."""

    state: State
    decided: list[Decision] = field(default_factory=list)

    def feed(self, event: Event) -> Decisions:
        """Apply :func:`decide` to the current state; returns the decisions."""
        self.state, decisions = decide(self.state, event)
        self.decided.extend(decisions)
        return decisions
