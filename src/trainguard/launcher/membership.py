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
                     not decline, a rank survives.
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
from typing import Mapping, Optional, Union

REQUEUE, BAD_INPUT, GIVE_UP = 75, 2, 76  # trainguard.exitcodes (not imported: this module imports nothing of ours)
DECISION_CODES = (REQUEUE, BAD_INPUT, GIVE_UP)
END_MEANINGS = {REQUEUE: "ranks stopped for requeue", BAD_INPUT: "bad input", GIVE_UP: "a rank gave up"}


def failed(code: Optional[int]) -> bool:
    """A worker's exit code is a failure: it has exited, neither with 0 nor with a decision code."""
    return code is not None and code not in (0, *DECISION_CODES)


# ---- state -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What a launch allows (fixed for the launch).

    Attributes:
        in_process: in-process recovery is on (``[recovery] in_process`` and more than one rank).
        max_replacements: ``[recovery] max_replacements`` (ranks replaced or grown back, per launch).
        max_restarts: ``[launcher] max_restarts`` (group restarts, per launch).
        min_ranks: ``[elastic] min_ranks`` (0: never shrink, never join in place).
        regrow: ``[elastic] regrow``: a withdrawn slot grows back when a spare is ready.
    """

    in_process: bool = True
    max_replacements: int = 8
    max_restarts: int = 3
    min_ranks: int = 0
    regrow: bool = False


@dataclass(frozen=True)
class Progress:
    """Facts for the give-up rule at a failure that may restart the group.

    Attributes:
        failure_step: the step the group failed in (one past the fewest steps a local rank
            completed, from the heartbeats), ``None`` when unknown.
        newest_ckpt: step of the newest committed checkpoint, ``None`` when there is none.
    """

    failure_step: Optional[int] = None
    newest_ckpt: Optional[int] = None


@dataclass(frozen=True)
class GiveUpRule:
    """The give-up rules besides the restart budget (``[supervisor] max_no_progress_restarts``,
    ``max_same_step_faults``): a restart cures a lost process, not a fault that recurs at the same
    step or a run that never reaches a newer checkpoint. Off (``enabled`` false) without the hang
    supervisor, whose heartbeats give the failure step.

    Attributes:
        max_no_progress: consecutive failures with no newer checkpoint before giving up.
        max_same_step: consecutive failures at the same step before giving up.
        last_ckpt, last_step, no_progress, same_step: what the earlier failures left.
    """

    enabled: bool = False
    max_no_progress: int = 3
    max_same_step: int = 3
    last_ckpt: Optional[int] = None
    last_step: Optional[int] = None
    no_progress: int = 0
    same_step: int = 0

    def after(self, p: Progress) -> tuple[GiveUpRule, Optional[str]]:
        """Count one failure; the rule after it, and why to give up (``None``: restart)."""
        if not self.enabled:
            return self, None
        no_progress = self.no_progress + 1 if p.newest_ckpt == self.last_ckpt else 0
        same = p.failure_step is not None and p.failure_step == self.last_step
        same_step = self.same_step + 1 if same else 1
        rule = replace(
            self, last_ckpt=p.newest_ckpt, last_step=p.failure_step, no_progress=no_progress, same_step=same_step
        )
        if same_step >= self.max_same_step:
            return rule, f"the fault recurs at step {p.failure_step} ({same_step} failures in a row at that step)"
        if no_progress >= self.max_no_progress:
            return rule, (
                f"{no_progress} consecutive failures without checkpoint progress (newest checkpoint: step {p.newest_ckpt})"
            )
        return rule, None


@dataclass(frozen=True)
class State:
    """A node agent's view of its group's membership.

    Attributes:
        limits: the launch's :class:`Limits`.
        world_size: ranks in the group now.
        local: this node's local ranks in the group now (not withdrawn).
        withdrawn: local ranks the group went on without (a shrink), until they grow back.
        forming: the kind of the generation this agent published that has not formed yet
            (``"replace"``, ``"shrink"``, ``"grow"``, ``"admit"``), or ``None``.
        settling: the kind of the generation that formed (or that another node's agent
            published: ``"followed"``; a new start of the group: ``"start"``) and with which the
            group has not completed a step yet, or ``None`` (the progress rule).
        replacements: ranks replaced or grown back so far in this launch.
        restarts: group restarts so far.
        stop: the stop signal forwarded to the ranks (its name), or ``None``.
        regrowing: the ranks were asked to checkpoint and stop for a membership change.
        ended: ``(exit code, reason)`` once the launch ends.
        give_up: the give-up rule and what earlier failures left in it.
        unproven: ``(kind, newest checkpoint step)`` of the last recovery in place that settled,
            with the newest committed checkpoint at that moment (``None``: none yet), until a
            newer one commits: a hang until then restarts the group (see the module's doc).
    """

    limits: Limits
    world_size: int
    local: frozenset[int]
    withdrawn: frozenset[int] = frozenset()
    forming: Optional[str] = None
    settling: Optional[str] = None
    replacements: int = 0
    restarts: int = 0
    stop: Optional[str] = None
    regrowing: bool = False
    ended: Optional[tuple[int, str]] = None
    give_up: GiveUpRule = GiveUpRule()
    unproven: Optional[tuple[str, Optional[int]]] = None

    @property
    def restarts_left(self) -> int:
        return self.limits.max_restarts - self.restarts

    @property
    def recovering(self) -> Optional[str]:
        """The kind of the recovery in place under way (forming, or formed and not settled), or ``None``."""
        return self.forming or self.settling


# ---- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Look:
    """The agent's one look at its workers in a poll.

    Attributes:
        codes: ``{local_rank: exit code, or None while running}``.
        declined: why the ranks declined in-process recovery (read from the store), or ``None``.
        spares_ready: warm spares waiting for an assignment.
        single_node: the group runs on this node only (only such a group shrinks: it renumbers ranks).
        ending: a rank has left training (exited 0, or tearing down after the run's end): a
            replacement would meet no one (a rank that fails in its interpreter's exit after the
            final save restarts the group, which resumes from the final checkpoint and ends).
    """

    codes: Mapping[int, Optional[int]]
    declined: Optional[str] = None
    spares_ready: int = 0
    single_node: bool = True
    ending: bool = False


@dataclass(frozen=True)
class Collected:
    """Torch's result for a group that failed (after **Collect**).

    Attributes:
        codes: ``{local_rank: exit code}`` of the failed workers.
        script_error: ``(exit code, reason)`` when the failure is an error of the script before
            its first step (:mod:`.script_error`), else ``None``.
        progress: facts for the give-up rule.
    """

    codes: Mapping[int, int]
    script_error: Optional[tuple[int, str]] = None
    progress: Progress = Progress()


@dataclass(frozen=True)
class Finished:
    """Every worker exited with 0."""


@dataclass(frozen=True)
class Joined:
    """The generation this agent published formed (every member said so)."""


@dataclass(frozen=True)
class Settled:
    """Every rank of the group completed a step after the last generation formed (``progress``:
    the newest committed checkpoint then, for :attr:`State.unproven`)."""

    progress: Progress = Progress()


@dataclass(frozen=True)
class TimedOut:
    """The generation this agent published did not form (``why``)."""

    why: str
    progress: Progress = Progress()


@dataclass(frozen=True)
class SettleTimedOut:
    """The group did not complete a step within the bound after the last generation formed, or a
    rank gave the recovery up before that step (``why``)."""

    why: str
    progress: Progress = Progress()


@dataclass(frozen=True)
class Hang:
    """The hang supervisor killed silent ranks (``reason``); ``unkillable``: one of them outlived
    its SIGKILL by ``kill_grace``."""

    reason: str
    unkillable: bool = False
    progress: Progress = Progress()


@dataclass(frozen=True)
class StopRequested:
    """A stop signal reached the launcher (``signal``: its name)."""

    signal: str


@dataclass(frozen=True)
class StopGraceExpired:
    """The ranks did not exit within ``stop_grace`` of the forwarded stop signal."""


@dataclass(frozen=True)
class NodesWaiting:
    """``count`` nodes wait in the rendezvous; ``abandoned``: an agent gave this start of the group up."""

    count: int
    abandoned: bool = False
    progress: Progress = Progress()


@dataclass(frozen=True)
class AdmitFailed:
    """The rendezvous with the waiting nodes failed (``why``)."""

    why: str
    progress: Progress = Progress()


@dataclass(frozen=True)
class Idle:
    """A poll in which nothing else happened; ``spares_ready``: warm spares waiting."""

    spares_ready: int = 0


@dataclass(frozen=True)
class NodeLost:
    """Another node's launcher and ranks vanished (``why``): node ``node`` (its group rank) with
    the global ``ranks``; ``spare``: a spare node waits. Without one the group restarts when the
    rendezvous has its nodes again."""

    why: str
    node: int = 0
    ranks: tuple[int, ...] = ()
    spare: bool = False
    progress: Progress = Progress()


@dataclass(frozen=True)
class Followed:
    """Another node's agent published a generation: the group now has ``world_size`` ranks."""

    world_size: int


@dataclass(frozen=True)
class GroupStarted:
    """A new start of the group with ``world_size`` ranks, ``local`` of them on this node."""

    world_size: int
    local: frozenset[int]


Event = Union[
    Look,
    Collected,
    Finished,
    Joined,
    Settled,
    TimedOut,
    SettleTimedOut,
    Hang,
    StopRequested,
    StopGraceExpired,
    NodesWaiting,
    AdmitFailed,
    Idle,
    NodeLost,
    Followed,
    GroupStarted,
]


# ---- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replace:
    """Start a replacement for each of these local ranks (a warm spare where one waits) and publish
    the generation they join."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ReplaceNode:
    """A spare node takes the place of lost node ``node`` (group rank): its warm spares become the
    global ``ranks``, and the generation they join is published."""

    node: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Shrink:
    """Publish the generation in which the group goes on without these local ranks."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class GrowBack:
    """Ready spares take these withdrawn local slots back."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Admit:
    """Join the waiting nodes' rendezvous round beside the running workers and grow in place."""

    count: int


@dataclass(frozen=True)
class CheckpointFirst:
    """Ask the ranks to checkpoint and stop (SIGTERM), then restart with the waiting nodes."""

    count: int


@dataclass(frozen=True)
class Fallback:
    """In-process recovery does not take this failure (``why``): say so (``recovery_fallback``);
    ``failed``: a recovery in place had started and did not lead to a completed step (its
    generation did not form, or a rank failed or hung before the group completed a step with it):
    ``recovery_failed``."""

    why: str
    failed: bool = False


@dataclass(frozen=True)
class KillSurvivors:
    """SIGCONT and SIGKILL the ranks still running (a peer failed: they cannot finish without it)."""


@dataclass(frozen=True)
class Collect:
    """Ask torch for the group's result (exit codes); a failed group's comes back as ``Collected``."""


@dataclass(frozen=True)
class Restart:
    """Stop the group and start it again from the newest checkpoint (one restart spent)."""

    reason: str


@dataclass(frozen=True)
class MembershipRestart:
    """The ranks stopped with a checkpoint for a membership change: start the group again with the
    new membership (no restart spent)."""


@dataclass(frozen=True)
class Forward:
    """Forward the stop signal to the ranks."""

    signal: str


@dataclass(frozen=True)
class End:
    """End the launch with ``code`` (stop the group first); ``kind`` names the rule that ended it
    (``give_up``, ``restart_budget_spent``, ``script_error``, ``stop_grace_expired``; ``""``: the
    ranks' own decision code, a stop, or success)."""

    code: int
    reason: str
    kind: str = ""
    cause: str = ""  # kind give_up: the rule's own reason (``reason`` = cause + ": " + the failure)


Decision = Union[
    Replace,
    ReplaceNode,
    Shrink,
    GrowBack,
    Admit,
    CheckpointFirst,
    Fallback,
    KillSurvivors,
    Collect,
    Restart,
    MembershipRestart,
    Forward,
    End,
]
Decisions = tuple[Decision, ...]


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
