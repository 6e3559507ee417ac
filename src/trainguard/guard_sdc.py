"""The Guard's response to silent data corruption: compare the replicas at a check step, then
warn, give up, or roll back to where they agreed and exclude the hosts of a persistent fault
(:mod:`trainguard.sdc`); re-run an unstable step to tell the hardware from the data
(:mod:`trainguard.rerun`).

A mixin of :class:`~trainguard.guard.Guard`, kept apart so that the loop in ``guard.py`` reads top
to bottom.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import console
from . import dist as tgdist
from .crosscheck import cross_check
from .instability.detect import Verdict
from .outcomes import GiveUp, Withdraw
from .rerun import step_result
from .sdc import Mismatch


class SDCResponse:
    """``_replicas_differ`` (the check at a step boundary; a persistent fault's ranks withdraw or
    every rank stops), ``_sdc_roll_back``, ``_rerun_step``
    and ``_rerun_verdict`` (an unstable step done again)."""

    def _rerun_step(self, verdict: Verdict, loss: Any) -> None:
        """The first run of step ``verdict.step`` is unstable on some rank: keep this rank's result,
        drop the gradients, put the data position and RNG streams back to the step's start; the
        step does not count and ``steps()`` yields it again (see :mod:`trainguard.rerun`)."""
        self.reruns.begin(verdict.step, step_result(loss, self.model))
        self.recovery.refuse()
        self.train_state.load_state_dict(self.rejoin.boundary.restore(self.step))
        self._rolled_back = True
        self._emit0(
            "step_rerun",
            step=verdict.step,
            detectors=verdict.fired,
            loss=verdict.loss,
            grad_norm=verdict.grad_norm,
            nonfinite_ranks=verdict.nonfinite_ranks,
        )

    def _rerun_verdict(self, loss: Any) -> bool:
        """This run is the re-run: compare it with the first (a collective), cross-check a single
        suspect rank on its partner, say the verdict. ``True``: a persistent fault was acted on
        (the step is not applied); ``False``: the caller applies the re-run's detector verdict."""
        value = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
        v = self.reruns.classify(step_result(loss, self.model), value)
        if v.suspect is not None and self.step_inputs is not None and not self.step_inputs.sharded:
            fps = cross_check(self.step_inputs, v.suspect, self.rank, self.world_size)
            if fps is not None and fps[0] != fps[1]:
                v = dataclasses.replace(v, verdict="persistent", ranks=[v.suspect], cross_check=fps)
            elif fps is not None:
                v = dataclasses.replace(v, cross_check=fps)
        hosts = [self.hosts[r] for r in v.ranks] if self.hosts else []
        self._emit0(
            "sdc_rerun",
            step=v.step,
            trigger="instability",
            verdict=v.verdict,
            ranks=v.ranks,
            hosts=hosts,
            first_seen=v.step,
            first_run=v.first,
            re_run=v.again,
            losses=v.losses,
            suspect=v.suspect,
            cross_check=v.cross_check,
        )
        if self.rank == 0 and v.verdict == "transient":
            console.warn(
                f"step {v.step} gave a different result when run again "
                + (f"(the loss of ranks {v.ranks} changed)" if v.ranks else "(only the gradients changed)")
                + ": a transient hardware fault; the re-run's result is used"
            )
        if v.verdict != "persistent":
            return False
        self._persistent_step_fault(v.step, v.ranks, hosts)
        return True

    def _persistent_step_fault(self, step: int, ranks: list[int], hosts: list[str]) -> None:
        """Rank(s) ``ranks`` compute step ``step`` wrongly every time: the step is not applied, its
        batch and random numbers are put back to be done again on good hardware, then
        ``[sdc] on_persistent``: raise, exclude (a stop, exit 75) or replace (the ranks withdraw).

        Raises:
            GiveUp: ``raise``. Requeue: ``exclude``. Withdraw: ``replace``, on the faulty ranks.
        """
        policy = self.cfg.sdc.on_persistent
        if policy == "replace" and not self.rejoin.active:
            policy = "exclude"
        if self.rank == 0:
            console.warn(
                f"silent data corruption: rank(s) {ranks} compute step {step} differently from their partner "
                f"on the same inputs: a persistent fault; {policy}"
            )
        self.recovery.refuse()
        self.train_state.load_state_dict(self.rejoin.boundary.restore(self.step))
        self._rolled_back = True  # steps() yields the step again
        if policy == "raise":
            raise GiveUp("sdc", f"rank(s) {ranks} compute step {step} wrongly every time ([sdc] on_persistent = raise)")
        if self.rank == 0:
            path = self.straggler.write_exclude(ranks)
            self.events.emit("sdc_exclude", step, ranks=ranks, hosts=hosts, exclude_nodes=str(path), action=policy)
        if policy == "replace":
            if self.rank in ranks:
                raise Withdraw("sdc", f"it computes step {step} differently from its partner: a persistent fault")
            return
        self._stop("sdc", ranks=ranks, hosts=hosts, exclude_nodes=str(self.run_dir / "exclude_nodes"))

    def _replicas_differ(self) -> bool:
        """The silent-data-corruption check of this step (a collective, see :mod:`trainguard.sdc`);
        ``True`` when the rest of the step boundary is skipped: it rolled back (the step counter
        is the checkpoint's), or a peer was lost in it and replaced in-process."""
        try:
            m = self.sdc.check(self.step)
        except Exception as e:
            if not self.rejoin.caught(e, "sdc_check", self.step):
                raise
            self._recover(redo=False)  # the step is complete: the next check compares the replicas
            return True
        suspect = self.sdc.suspect
        verdict = self.sdc.verdict(self.step, m)
        if verdict is not None:
            self._emit0(
                "sdc_rerun",
                verdict=verdict,
                ranks=suspect.ranks,
                hosts=[self.hosts[r] for r in suspect.ranks] if self.hosts else [],
                first_seen=suspect.step,
                fingerprints=self.sdc.values,
                trigger="replicas",
            )
        if m is None:
            return False
        persistent = verdict == "persistent"
        policy = self.cfg.sdc.on_persistent if persistent else self.cfg.sdc.on_mismatch
        if policy == "replace" and (not self.rejoin.active or len(m.ranks) == self.world_size):
            policy = "exclude"  # no in-process recovery, or no rank left to trust: stop and requeue instead
        hosts = [self.hosts[r] for r in m.ranks] if self.hosts else []
        self._emit0(
            "sdc_mismatch",
            ranks=m.ranks,
            hosts=hosts,
            last_good=m.last_good,
            fingerprints=m.fingerprints,
            action=policy,
        )
        if self.rank == 0:
            console.warn(
                f"silent data corruption: the replicas of ranks {m.ranks} differ at step {self.step} "
                f"(they agreed at step {m.last_good})"
                + (", again after a re-run: persistent" if persistent else "")
                + f"; {policy}"
            )
        if policy == "warn":
            return False
        if policy == "raise":
            raise GiveUp("sdc", f"the replicas of ranks {m.ranks} differ at step {self.step} ([sdc] raise)")
        self._sdc_roll_back(m)
        if not persistent:
            return True
        # back at a clean state; the hosts are left out of the next allocation either way
        if self.rank == 0:
            path = self.straggler.write_exclude(m.ranks)
            self.events.emit(
                "sdc_exclude", self.step, ranks=m.ranks, hosts=hosts, exclude_nodes=str(path), action=policy
            )
        if policy == "replace":  # the bad ranks leave; the others meet their spares at the next collective
            if self.rank in m.ranks:
                raise Withdraw("sdc", f"its replica differs again after a re-run at step {m.step}: a persistent fault")
            return True
        self._stop("sdc", ranks=m.ranks, hosts=hosts, exclude_nodes=str(self.run_dir / "exclude_nodes"))
        return True

    def _sdc_roll_back(self, m: Mismatch) -> None:
        """Reload the newest checkpoint at or before the last agreeing check on every rank and set
        the newer ones aside (a save after the corruption may hold the bad replica's tensors).

        Raises:
            GiveUp: no valid checkpoint at or before that step.
        """
        with self.section("rollback"):
            self._saved(self.ckpt.wait())
            target = (
                self.store.latest_valid(self.cfg.checkpoint.verify, before=m.last_good + 1) if self.rank == 0 else None
            )
            target = tgdist.broadcast_object(target)
            if target is None:
                raise GiveUp(
                    "sdc",
                    f"the replicas differ at step {self.step} and no checkpoint is at or before step {m.last_good}, where they last agreed",
                )
            from_step, why = self.step, f"silent data corruption found at step {self.step}"
            if self.rank == 0:
                self.store.set_aside_after(target.step, why)
            self._reload(target, why)
            if self.rejoin.keeping:
                self._keep_boundary(self.step)
            self._emit0("sdc_rollback", from_step=from_step, to_step=target.step, path=str(target.path))
        if self.heartbeat is not None:  # the step section was closed at this boundary already
            self.heartbeat.beat(self.step)
