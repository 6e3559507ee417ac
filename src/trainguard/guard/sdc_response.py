"""The Guard's response to silent data corruption: judge a replica check or a step's re-run and
decide what follows (see :mod:`trainguard.sdc.replicas` and :mod:`trainguard.sdc.rerun`).

A component of :class:`~trainguard.guard.Guard`: it writes the events and the console lines of a
finding and returns an :class:`SDCAction` (or raises :class:`~trainguard.outcomes.GiveUp` under
the ``raise`` policy); the Guard carries the action out (it holds the checkpoints, the step
counter and the stop).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import console
from ..events import EventLog
from ..instability.detect import Verdict
from ..outcomes import GiveUp
from ..sdc.crosscheck import StepInputs, cross_check
from ..sdc.replicas import Mismatch, ReplicaCheck
from ..sdc.rerun import StepRerun, step_result
from ..sections import SDCSection
from .world import World


@dataclass(frozen=True)
class SDCAction:
    """What the Guard does after a finding, in this order.

    Attributes:
        redo_step: put back the state of the step's start (data position, RNG streams); the step
            does not count and ``steps()`` yields it again.
        roll_back: reload the newest checkpoint at or before ``roll_back.last_good`` (where the
            replicas last agreed) and set the newer ones aside.
        exclude: the ranks of a persistent fault: rank 0 writes their hosts to
            ``RUN_DIR/exclude_nodes``; then, with ``policy = "replace"``, those ranks withdraw
            (``message`` says why) and the others meet their spares; with ``"exclude"`` every rank
            saves and stops (exit 75).
        policy: the ``[sdc]`` policy acted on.
        step: the step the ``sdc_exclude`` event names (``None``: the step after the rollback).
        hosts: the hosts of ``exclude`` (empty when unknown).
    """

    redo_step: bool = False
    roll_back: Optional[Mismatch] = None
    exclude: tuple[int, ...] = ()
    policy: str = ""
    step: Optional[int] = None
    hosts: tuple[str, ...] = ()
    message: str = ""


class SDCResponse:
    """Judges silent-data-corruption evidence for one rank.

    Args:
        cfg: the ``[sdc]`` section.
        check: the replica check (:class:`~trainguard.sdc.replicas.ReplicaCheck`).
        reruns: the step re-run state (:class:`~trainguard.sdc.rerun.StepRerun`).
        step_inputs: the recorded inputs of the step (a re-run's cross-check), or ``None``.
        events: the event log.
        can_replace: in-process recovery is active (``replace`` needs it; else ``exclude``).
        world: the shared view (this rank and the world size now: a shrink or growth renumbers it).
    """

    def __init__(
        self,
        cfg: SDCSection,
        check: ReplicaCheck,
        reruns: StepRerun,
        step_inputs: Optional[StepInputs],
        events: EventLog,
        can_replace: bool,
        world: World,
    ):
        self.cfg, self.check, self.reruns, self.step_inputs = cfg, check, reruns, step_inputs
        self.events, self.can_replace, self.world = events, can_replace, world

    def _emit0(self, kind: str, step: int, **details: Any) -> None:
        if self.world.rank == 0:
            self.events.emit(kind, step, **details)

    # ------------------------------------------------------------------------------------------
    # a step done again (an unstable step: the hardware or the data?)

    def rerun(self, verdict: Verdict, loss: Any, model: torch.nn.Module) -> SDCAction:
        """The first run of step ``verdict.step`` is unstable on some rank: keep this rank's result
        and ask for the step again from its start."""
        self.reruns.start(verdict.step, step_result(loss, model))
        self._emit0(
            "step_rerun",
            verdict.step,
            detectors=verdict.fired,
            loss=verdict.loss,
            grad_norm=verdict.grad_norm,
            nonfinite_ranks=verdict.nonfinite_ranks,
        )
        return SDCAction(redo_step=True)

    def rerun_verdict(self, loss: Any, model: torch.nn.Module, hosts: list[str]) -> Optional[SDCAction]:
        """This run is the re-run: compare it with the first (a collective), cross-check a single
        suspect rank on its partner, say the verdict. Returns the action for a persistent fault
        (the step is not applied), ``None`` otherwise (the caller applies the re-run's detector
        verdict).

        Raises:
            GiveUp: a persistent fault under ``[sdc] on_persistent = "raise"``.
        """
        value = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
        v = self.reruns.classify(step_result(loss, model), value)
        if v.suspect is not None and self.step_inputs is not None and not self.step_inputs.sharded:
            fps = cross_check(self.step_inputs, v.suspect, self.world.rank, self.world.world_size)
            if fps is not None and fps[0] != fps[1]:
                v = dataclasses.replace(v, verdict="persistent", ranks=[v.suspect], cross_check=fps)
            elif fps is not None:
                v = dataclasses.replace(v, cross_check=fps)
        named = [hosts[r] for r in v.ranks] if hosts else []
        self._emit0(
            "sdc_rerun",
            v.step,
            trigger="instability",
            verdict=v.verdict,
            ranks=v.ranks,
            hosts=named,
            first_seen=v.step,
            first_run=v.first,
            re_run=v.again,
            losses=v.losses,
            suspect=v.suspect,
            cross_check=v.cross_check,
        )
        if self.world.rank == 0 and v.verdict == "transient":
            console.warn(
                f"step {v.step} gave a different result when run again "
                + (f"(the loss of ranks {v.ranks} changed)" if v.ranks else "(only the gradients changed)")
                + ": a transient hardware fault; the re-run's result is used"
            )
        if v.verdict != "persistent":
            return None
        return self._persistent_step_fault(v.step, v.ranks, named)

    def _persistent_step_fault(self, step: int, ranks: list[int], hosts: list[str]) -> SDCAction:
        """Rank(s) ``ranks`` compute step ``step`` wrongly every time: the step is not applied, its
        batch and random numbers are put back to be done again on good hardware, then
        ``[sdc] on_persistent``: raise, exclude (a stop, exit 75) or replace (the ranks withdraw).

        Raises:
            GiveUp: ``raise``.
        """
        policy = self.cfg.on_persistent
        if policy == "replace" and not self.can_replace:
            policy = "exclude"
        if self.world.rank == 0:
            console.warn(
                f"silent data corruption: rank(s) {ranks} compute step {step} differently from their partner "
                f"on the same inputs: a persistent fault; {policy}"
            )
        if policy == "raise":
            raise GiveUp("sdc", f"rank(s) {ranks} compute step {step} wrongly every time ([sdc] on_persistent = raise)")
        message = f"it computes step {step} differently from its partner: a persistent fault"
        return SDCAction(
            redo_step=True, exclude=tuple(ranks), policy=policy, step=step, hosts=tuple(hosts), message=message
        )

    # ------------------------------------------------------------------------------------------
    # the replica check

    def judge(self, step: int, m: Optional[Mismatch], hosts: list[str]) -> Optional[SDCAction]:
        """The replica check at step ``step`` found ``m`` (``None``: the replicas agree): say so
        and decide. Returns ``None`` when training goes on as it is (no mismatch, or ``warn``).

        Raises:
            GiveUp: ``raise`` (``[sdc] on_mismatch``, or ``on_persistent`` after a re-run).
        """
        suspect = self.check.suspect
        verdict = self.check.verdict(step, m)
        if verdict is not None:
            self._emit0(
                "sdc_rerun",
                step,
                verdict=verdict,
                ranks=suspect.ranks,
                hosts=[hosts[r] for r in suspect.ranks] if hosts else [],
                first_seen=suspect.step,
                fingerprints=self.check.values,
                trigger="replicas",
            )
        if m is None:
            return None
        persistent = verdict == "persistent"
        policy = self.cfg.on_persistent if persistent else self.cfg.on_mismatch
        if policy == "replace" and (not self.can_replace or len(m.ranks) == self.world.world_size):
            policy = "exclude"  # no in-process recovery, or no rank left to trust: stop and requeue instead
        named = [hosts[r] for r in m.ranks] if hosts else []
        self._emit0(
            "sdc_mismatch",
            step,
            ranks=m.ranks,
            hosts=named,
            last_good=m.last_good,
            fingerprints=m.fingerprints,
            action=policy,
        )
        if self.world.rank == 0:
            console.warn(
                f"silent data corruption: the replicas of ranks {m.ranks} differ at step {step} "
                f"(they agreed at step {m.last_good})"
                + (", again after a re-run: persistent" if persistent else "")
                + f"; {policy}"
            )
        if policy == "warn":
            return None
        if policy == "raise":
            raise GiveUp("sdc", f"the replicas of ranks {m.ranks} differ at step {step} ([sdc] raise)")
        if not persistent:
            return SDCAction(roll_back=m)
        # back at a clean state; the hosts are left out of the next allocation either way
        message = f"its replica differs again after a re-run at step {m.step}: a persistent fault"
        return SDCAction(roll_back=m, exclude=tuple(m.ranks), policy=policy, hosts=tuple(named), message=message)
