"""The Guard's in-process recovery (see :mod:`trainguard.rejoin`): a survivor meets the replacement
of a lost rank, a replacement joins the survivors.

A mixin of :class:`~trainguard.guard.Guard`, kept apart so that the loop in ``guard.py`` reads top
to bottom; it works on the Guard's own components (``rejoin``, ``ckpt``, ``train_state``, ...).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Optional

from torch.nn.parallel import DistributedDataParallel as DDP

from . import console, health
from . import dist as tgdist
from .rejoin import boundary as rejoin_boundary
from .rejoin import regroup, sever, shrink
from .rejoin.catch import CATCH, DDPHook
from .rejoin.protocol import Generation, new_rank
from .rejoin.rank import LOCAL_PARTS
from .reshard import resharded_rank_state


class InProcessRecovery:
    """``_recover`` (a survivor), ``_grow`` (the group grows back), ``_join`` (a replacement or a
    newcomer), ``_meet`` (all of them), ``_keep_boundary``."""

    def _recover(self, redo: bool) -> None:
        """A peer was lost in this step: meet its replacement in the launcher's next generation and
        send it the state; with ``redo`` restore this rank's step-boundary state so that the step
        runs again from the same batch and random numbers.

        Raises:
            the collective's error: no new generation within ``[recovery] timeout`` (this rank
            exits and the launcher restarts the group).
            RegroupError: the ranks cannot be recovered in-process (same).
        """
        failure = self.rejoin.failure
        with self.section("recovery"):
            self.events.emit(
                "recovery_started", failure.step, rank=self.rank, during=failure.during, error=str(failure.error)[:300]
            )
            regroup.check_rebindable(self.model)
            if self.ping is not None:  # its group lost the peer too
                self.ping.abandon()
                self.ping = None
            self._saved(self.ckpt.wait())  # a save in flight fails on its broken group; nothing commits
            # this rank's own state now: the end of the abandoned step (a peer may have completed it)
            current = self.train_state.state_dict(LOCAL_PARTS) if redo else None
            gen = self.rejoin.wait_generation()
            if gen.left:
                self._resize(gen)
            regroup.release_ddp(self.model)
            regroup.rebuild_default_group(gen, self._backend, self.cfg.recovery.timeout)
            regroup.rebind_ddp(self.model, self._bucket_layout())
            self.ckpt.regroup()
            if redo:  # back to the step's start before any state is sent from here
                self.train_state.load_state_dict(self.rejoin.boundary.restore(self.step))
                self.step_start.restore()
            before = self.step
            self._meet(gen, current=current)
            redo = redo and self.step == before  # else it took the completed step from a peer
            self.reruns.forget()  # a replacement knows of no re-run in progress
            if gen.left:
                self.rejoin.store.joined(gen.number, self.rank)
        self.shutdown.deadline_timer.cancel()  # armed by the ping's failure
        self.events.emit(
            "recovery_finished",
            self.step,
            rank=self.rank,
            generation=gen.number,
            replaced=list(gen.replaced),
            left=list(gen.left),
            world_size=self.world_size,
            seconds=round(time.time() - failure.at, 4),
            steps_lost=0,
            redo_step=failure.step if redo else None,
        )
        self.rejoin.done()

    def _grow(self, number: int) -> None:
        """The ranks agreed at this step boundary that the group grows back in place into
        generation ``number`` (see :mod:`~trainguard.rejoin.shrink`): stop the liveness ping, finish
        a save in flight, take the larger world size, meet the newcomers in the new group and send
        them the state. Nothing is redone: the step is complete.

        Raises:
            RuntimeError, torch.distributed.DistError: the new group could not be formed (this rank
                exits and the launcher restarts the group).
        """
        t0 = time.time()
        with self.section("recovery"):
            gen = self.rejoin.grown_generation(number)
            if self.ping is not None:  # a collective on the old group, at the same point on every rank
                self.ping.stop()
                self.ping.close()
                self.ping = None
            self._saved(self.ckpt.wait())
            self._resize(gen)
            regroup.rebuild_default_group(gen, self._backend, self.cfg.recovery.timeout)
            regroup.rebind_ddp(self.model, self._bucket_layout())
            self.ckpt.regroup()
            self._meet(gen)
        if self.rank == 0:
            self.events.emit(
                "group_grown",
                self.step,
                generation=gen.number,
                joined=list(gen.grown),
                world_size=self.world_size,
                seconds=round(time.time() - t0, 4),
            )

    def _resize(self, gen: Generation) -> None:
        """The group goes on without the ranks ``gen.left`` (a shrink) or with the newcomers
        ``gen.grown`` (it grows back; see :mod:`~trainguard.rejoin.shrink`): take this rank's
        number and the world size everywhere, before the new group is created with them."""
        old, rank = self.rank, new_rank(self.rank, gen.left)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(gen.world_size))
        self.hosts = [h for r, h in enumerate(self.hosts) if r not in gen.left]
        self.hosts += list(gen.hosts) or [socket.gethostname()] * len(gen.grown)  # spares run beside us
        self.events.renumber(rank)
        for part in (self.ckpt, self.recovery, self.sdc, self.micro, self.reruns):
            part.renumber(rank, gen.world_size)
        self.straggler.renumber(rank, gen.world_size, self.hosts)
        self.fidelity.renumber(gen.world_size)
        self.rejoin.renumber(rank)
        shrink.reshard(self.sampler, rank, gen.world_size)
        self.events.emit(
            "world_size_changed",
            self.step,
            from_world_size=self.world_size,
            to_world_size=gen.world_size,
            base_world_size=self.elastic.base_world_size,
            keep=self.cfg.elastic.keep,
            left=list(gen.left),
            joined=list(gen.grown),
            from_rank=old,
            in_process=True,
        )
        if rank == 0:
            change = f"without rank(s) {list(gen.left)}" if gen.left else f"with rank(s) {list(gen.grown)} back"
            console.say(
                f"going on as {gen.world_size} rank(s) {change} from step {self.step}: "
                f"data position carried over, keep {self.cfg.elastic.keep.replace('_', ' ')}"
            )
        self.rank, self.world_size = rank, gen.world_size

    def _join(self) -> None:
        """A replacement of a lost rank starts here instead of resuming: its own state at the last
        step boundary from the lost rank's file, the model and optimizer from the survivors. A
        newcomer of a group that grows back (``gen.grown``) has no such file: it derives its own
        state from the lowest surviving rank's (see :meth:`_transfer`)."""
        t0 = time.monotonic()
        gen = self.rejoin.joined_generation()
        grown = self.rank in gen.grown
        kept = {} if grown else rejoin_boundary.read(self.rejoin.dir, self.rank)
        self._meet(gen, kept)
        self._arm_catch()  # the script's collectives before its loop completed here alone (rejoin.catch)
        self.recovery.rejoined()
        self._keep_boundary(self.step)
        self.rejoin.store.joined(gen.number, self.rank)
        said = dict(rank=self.rank, generation=gen.number, pid=os.getpid(), seconds=round(time.monotonic() - t0, 4))
        if grown:
            self.events.emit("rank_joined", self.step, **said)
        else:
            self.events.emit("rank_replaced", self.step, **said)
        self._t_last = time.perf_counter()

    def _meet(
        self, gen: Generation, kept: Optional[dict[int, dict]] = None, current: Optional[dict[str, Any]] = None
    ) -> None:
        """Both sides of a recovery, in the same order: agree on the survivors' step boundary (a
        replacement, with the lost rank's ``kept`` boundaries, takes the one of that step), move the
        model, optimizer and the state every rank holds alike from the lowest surviving rank to
        the replacements (none after a shrink: the survivors hold the same), start the liveness
        ping on the new group.

        The survivors may be one step apart: a collective that lost a peer can complete on some
        ranks and fail on others (gloo's ring). The ranks that abandoned the step (``current``:
        their own state at its end, :meth:`_recover`) then take the completed step from the
        lowest rank that has it, as a replacement does: nothing is redone.

        Raises:
            RegroupError: the survivors are more than one step apart, or the lost rank kept none of theirs.
        """
        joining = kept is not None
        agreed = tgdist.all_reduce_max([-1, -(1 << 62)] if joining else [self.step, -self.step])
        step, lowest = agreed[0], -agreed[1]
        behind = not joining and self.step < step
        refused = tgdist.all_reduce_max(
            [int(joining and step not in kept and self.rank not in gen.grown), int(behind and current is None)]
        )
        if step - lowest > 1 or refused[1]:
            raise regroup.RegroupError(f"the ranks are at different step boundaries ({lowest} to {step})")
        if refused[0]:
            raise regroup.RegroupError(
                f"a replacement has no state of step {step} (its rank kept {sorted(kept or ())})"
            )
        src = None
        if step != lowest:  # the lowest rank that completed the step sends it
            src = -tgdist.all_reduce_max([-self.rank if not joining and not behind else -(1 << 62)])[0]
        if gen.replaced or src is not None:
            self._transfer(gen, step, kept, src, current if behind else None)
        self.rejoin.group_ports = {p for ps in tgdist.gather_objects(sever.listening_ports()) for p in ps}
        device = next(self.model.parameters()).device
        self.ping = health.start_ping(
            self.cfg.health, self.hosts, self.events, device, self.world_size, self._on_ping_failure
        )

    def _transfer(
        self,
        gen: Generation,
        step: int,
        kept: Optional[dict[int, dict]],
        src: Optional[int] = None,
        current: Optional[dict[str, Any]] = None,
    ) -> None:
        """Move the model, optimizer and shared state from rank ``src`` (default: the lowest
        surviving rank) to the replacements of ``gen`` (``kept``: a replacement's boundaries,
        ``None`` on a survivor) and to survivors one step behind (``current``: their own state at
        ``step``). A newcomer (``gen.grown``) takes that rank's own state too, with the data
        position and RNG streams derived for its rank as on a resume on another world size
        (:func:`~trainguard.reshard.resharded_rank_state`)."""
        joining = kept is not None
        src = min(set(range(gen.world_size)) - set(gen.replaced)) if src is None else src
        t0 = time.perf_counter()
        parts = [n for n in self.train_state.parts if gen.grown or n not in LOCAL_PARTS]
        shared = {
            "layout": self._bucket_layout(),
            "hosts": self.hosts,
            "next_check": step + 1,
            "next_report": self.straggler.next_report,
            "state": self.train_state.state_dict(parts) if self.rank == src else None,
        }
        packet, moved = regroup.transfer_state(self.model, self.optimizer, src, shared)
        if joining:
            self.step = step
            if packet["layout"]:  # the survivors' buckets, so that the sums round as theirs do
                regroup.rebind_ddp(self.model, packet["layout"])
            if self.rank in gen.grown:
                own = resharded_rank_state({**packet["state"], "step": step}, self.rank)
            else:
                own = kept[step]
            self.train_state.load_state_dict({**packet["state"], **own})
        elif current is not None:
            self.step = step
            self.train_state.load_state_dict({**packet["state"], **current})
        if self.rank == src:
            self.events.emit(
                "state_transferred",
                self.step,
                rank=src,
                to_ranks=list(gen.replaced),
                bytes=moved,
                seconds=round(time.perf_counter() - t0, 4),
            )
        self.hosts = packet["hosts"]
        self.straggler.set_hosts(self.hosts)
        self._next_check, self.straggler.next_report = packet["next_check"], packet["next_report"]

    def _in_process_declined(self) -> Optional[str]:
        """Why in-process recovery does not apply to this loop, ``None`` if it does: a framework
        drives it, or the model cannot be moved to a new group (:func:`~.rejoin.regroup.check_rebindable`)."""
        if self._framework is not None:
            return f"{self._framework} owns the process group and the training loop"
        try:
            regroup.check_rebindable(self.model)
        except regroup.RegroupError as e:
            return str(e)
        return None

    def _say_where_in_process_applies(self, launch: Any) -> None:
        """Rank 0, once at start: why in-process recovery (on by default) does not apply, if it does not."""
        if self.rejoin.declined is not None:
            console.say(
                f"in-process recovery does not apply ({self.rejoin.declined}): "
                "a lost rank restarts the group from the newest checkpoint"
            )
        elif self.cfg.recovery.in_process and not launch.recovery_store and self.world_size > 1:
            console.say(
                "in-process recovery needs `trainguard run` (this run was launched otherwise): "
                "a lost rank ends the run as its launcher decides"
            )

    def _catch_collectives(self) -> None:
        """Catch a lost peer in the collectives the script runs itself (see
        :mod:`~trainguard.rejoin.catch`): DDP's gradient all-reduce through trainguard's
        communication hook, the script's ``torch.distributed`` calls. A replacement catches from
        the moment it joined."""
        if isinstance(self.model, DDP):
            params, _ = self.model._build_params_for_reducer()
            self.ddp_hook = DDPHook(CATCH, params, self._keep_before_last_bucket)
            self.model.register_comm_hook(None, self.ddp_hook.hook)
        if not self.rejoin.joining:
            self._arm_catch()

    def _bucket_layout(self) -> Optional[list[list[int]]]:
        """DDP's current bucket layout, as trainguard's hook last saw it (``None`` without it)."""
        return self.ddp_hook.layout if self.ddp_hook is not None and self.ddp_hook.layout else None

    def _arm_catch(self) -> None:
        CATCH.arm(lambda e, where: self.rejoin.caught(e, where, self.step + 1), self.rejoin.failed)

    def _keep_before_last_bucket(self) -> None:
        """DDP is about to send the step's last gradient bucket: keep this rank's own state as the
        boundary of the step in progress (after the send a peer may complete the step)."""
        step = self.step + 1
        if self.rejoin.keeping and self.rejoin.failure is None and self.rejoin.boundary.step != step:
            self._keep_boundary(step)

    def _keep_boundary(self, step: int) -> None:
        """Keep this rank's own state as the boundary of step ``step`` (in-process recovery)."""
        self.rejoin.keep({"step": step, **self.train_state.state_dict(LOCAL_PARTS)})
