"""Incidents: what counts as one, their kinds, and what is known about each.

An *incident* is a failure or a stop, with when it began (``failed_at``: the moment the loop stopped
making progress), when it was seen (``detected_at``), when training went on (``recovered_at``: the
next ``start``, or for in-process recoveries the ``rollback`` / ``micro_batch_split`` event, or a
survivor's ``recovery_finished`` after a lost rank was replaced in-process) and
the steps it cost (failure step − the step training went on from). Sources:

* ``workers_failed`` with a crash code → ``rank_killed`` (a signal), ``rank_withdrawn`` (77: a
  rank left the group with a persistent silent data corruption, ``[sdc] on_persistent = "replace"``)
  or ``rank_crashed`` (another exit code); exit codes 0, 2, 75 and 76 are decisions, reported by the
  events that made them;
* ``hang_detected`` (all ranks of one poll are one incident) → ``hang``; ``ping_timeout`` → ``ping_timeout``;
* ``stop_requested`` → ``preemption_signal``, ``time_limit``, ``kill_switch``, ``memory``, ``straggler``
  (a ``signal`` stop after the launcher's ``membership_change`` → ``membership_change``: a node joins);
* ``rollback`` → ``instability_rollback``; ``micro_batch_split`` → ``oom_split``; ``sdc_rollback``
  → ``sdc_rerun`` (a silent data corruption, rolled back and re-run; all three in-process); a
  ``stop_requested`` with reason ``sdc`` → ``sdc_exclude``; an ``sdc_rerun`` of an unstable step
  with the verdict ``transient`` → ``sdc_transient`` (the step done again, in-process);
* ``give_up``, ``restart_budget_spent``, ``instability_give_up``, ``oom_give_up`` → ``give_up``;
  ``bad_input`` → ``bad_input``; a launch without ``launch_exit`` → ``launch_lost``.

An incident is *injected* when a ``fault_injected`` event of a matching fault kind came earlier in
the same launch and attempt (launcher events carry attempt 0; the launcher's attempt is the
``restart`` of the latest ``workers_started``). Its fault's time and step then are the failure's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .timeline import Segment

# failures that cost the work since the newest checkpoint: the "M" of Young/Daly
FAILURE_KINDS = ("rank_killed", "rank_crashed", "rank_withdrawn", "hang", "ping_timeout", "launch_lost", "node_lost")
STOP_KINDS = {
    "signal": "preemption_signal",
    "time_limit": "time_limit",
    "kill_switch": "kill_switch",
    "memory": "memory",
    "straggler": "straggler",
    "sdc": "sdc_exclude",
}
IN_PROCESS_ROLLBACKS = ("instability_rollback", "sdc_rerun")  # reload a checkpoint in the same processes
NUMERIC_FAULTS = ("nan_loss", "loss_spike", "grad_explosion")
FAULTS_FOR = {
    "rank_killed": ("rank_killed",),
    "rank_crashed": ("rank_killed",),
    "hang": ("rank_hung",),
    "ping_timeout": ("rank_hung",),
    "instability_rollback": NUMERIC_FAULTS,
    "oom_split": ("oom",),
    "straggler": ("slow_rank",),
    "sdc_rerun": ("sdc",),
    "sdc_exclude": ("sdc",),
    "sdc_transient": ("sdc",),
    "rank_withdrawn": ("sdc",),
}
DECISION_CODES = (0, 2, 75, 76)  # exit codes that are decisions, not crashes (0 first)
# events counted in the report's notices (no incident of their own)
NOTICE_KINDS = (
    "step_skipped",
    "step_rerun",
    "instability",
    "straggler_detected",
    "memory_watchdog",
    "micro_batch_grow",
    "checkpoint_invalid",
    "checkpoint_failed",
    "deadline_exit",
    "stop_grace_expired",
    "membership_change",
    "membership_restart",
)


@dataclass
class Incident:
    """One failure or stop. Times are Unix seconds; steps are completed steps.

    ``failed_at``: when progress stopped; ``detected_at``: the event that reported it;
    ``recovered_at``: the next ``start`` (or the in-process recovery); ``step``: the failure step
    (``step_estimated`` when extrapolated from the step rate); ``resumed_step``: where training
    went on from; ``latency``: fault (or signal) → detection; ``in_process``: recovered without a
    restart; ``terminal``: the launch ended for good (give up, bad input); ``segment``: the
    training loop it ended.
    """

    kind: str
    launch: int
    attempt: int
    detected_at: float
    failed_at: float
    ranks: list = field(default_factory=list)
    step: Optional[float] = None
    step_estimated: bool = False
    injected: bool = False
    fault_at: Optional[float] = None
    latency: Optional[float] = None
    recovered_at: Optional[float] = None
    resumed_step: Optional[float] = None
    in_process: bool = False
    terminal: bool = False
    reason: str = ""
    segment: Optional[Segment] = None

    @property
    def planned(self) -> bool:
        """A stop that saved first (no work lost) rather than a failure."""
        return self.kind in STOP_KINDS.values()
