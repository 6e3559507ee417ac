"""The membership state machine's data (:mod:`.membership` holds its rules): the launcher's
:class:`State`, the events it decides on (what the agent saw) and the decisions it returns. Plain
frozen values; like the rules, this module imports nothing of trainguard's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
