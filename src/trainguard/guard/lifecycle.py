"""The start and the end of training (:class:`Lifecycle`), the Guard's ``begin()`` and ``finish()``.

At the start, on every rank (collectives): the kill switch is read by all ranks at once, every
rank's host and listening ports are gathered, the run resumes from the newest valid checkpoint
(or a replacement of a lost rank joins the survivors instead), the liveness ping starts, rank 0
writes the ``start`` event and says how it started. At the end: the last step's replica check is
settled, the final save, the ``end`` event with the state's SHA-256, and the ranks leave together.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import console, health
from .. import dist as tgdist
from ..checkpoint.store import Checkpoint
from ..config import dump_config
from ..outcomes import BadInput, Requeue
from ..rejoin import sever
from ..state.determinism import state_hash
from ..supervisor.rank import enter_teardown
from .context import Context
from .resume import DRAWN_BEFORE_LOOP


class Lifecycle:
    """The start and end of one rank's training.

    Args:
        ctx: the Guard's :class:`~.context.Context` (``[checkpoint]``, ``[health]``, ``[run] dir``;
            the world: the start sets its step, hosts and ping, the end stops the ping; the model
            and optimizer, hashed at the end; the hooks, told ``on_train_begin``, ``on_train_end``).
        parts: the Guard's :class:`~.parts.Parts`, built before this one (the resume, the stop
            conditions, in-process recovery, the detectors, the checkpointer, the event log); their
            ``begin`` (the component protocol) runs once training starts.
        on_ping_failure: given to the liveness ping.
    """

    def __init__(self, ctx: Context, parts: Any, on_ping_failure: Callable[[str], None]):
        self.ctx, self.cfg, self.world, self.p, self.on_ping_failure = ctx, ctx.cfg, ctx.world, parts, on_ping_failure
        self.model, self.optimizer = ctx.script.model, ctx.script.optimizer

    def begin(self, max_steps: int) -> tuple[Optional[Checkpoint], float]:
        """Start training to ``max_steps`` (see :meth:`~.guard.Guard.begin`); a collective.

        Returns:
            The checkpoint resumed from (``None``: a fresh start, or a replacement that joined),
            and the ``time.perf_counter()`` from which the first step is timed (seconds).
        Raises:
            BadInput: ``checkpoint.interval`` > ``max_steps`` without ``save_final``, a checkpoint
                that does not fit.
            Requeue: the kill switch is set (exit code 75).
        """
        p, world = self.p, self.world
        c = self.cfg.checkpoint
        if not c.save_final and c.interval > max_steps:
            raise BadInput(
                f"checkpoint.interval ({c.interval}) is larger than max_steps ({max_steps}) and "
                "checkpoint.save_final is false: the persistent tier would never save"
            )
        joining = p.rejoin.joining
        resumed_from, started = self._join() if joining else self._start()
        p.faults.arm(max_steps)
        p.faults.watch_activations(self.model, lambda: world.step + 1)
        # a loop of the script's own, not a framework's (Lightning's resumed runs ended bitwise where the
        # seed check named a draw, tests/test_lightning.py: why was not found): draws after the resume are said
        script = self.ctx.script
        own_loop = not (script.redo_in_step or script.framework)
        # nanoGPT's prefetch: a first batch drawn before the generators were restored (state.fidelity)
        p.draws.watch_first_step(
            self.model,
            joining or resumed_from is not None,
            lambda cause: p.resumer.not_bitwise(world.step, cause, say=joining),
            p.train_state,  # the data position: loaders whose position it does not hold are said
            seeds=own_loop,  # and iterators made after the resume that drew their seed from torch's generator
        )
        if (joining or resumed_from is not None) and own_loop:
            p.draws.watch_begin()  # draws before its first step are said
        return resumed_from, started

    def _join(self) -> tuple[None, float]:
        """A replacement of a lost rank (or a newcomer) joins the survivors instead of resuming."""
        drawn = self.p.draws.before_loop()  # a replacement runs the script's start as a resume does
        started = self.p.recovering.join()
        self.p.call("begin", self.world.step)
        if drawn:
            self.p.resumer.not_bitwise(self.world.step, DRAWN_BEFORE_LOOP, say=True)  # said by the replacement
        return None, started

    def _start(self) -> tuple[Optional[Checkpoint], float]:
        p, world, run_dir = self.p, self.world, self.cfg.run.dir
        if tgdist.all_reduce_max([int(p.stop.kill_switch())])[0]:
            if world.rank == 0:
                path = str(p.stop.kill_path)
                p.events.emit("stop_requested", world.step, reason="kill_switch", before_training=True, path=path)
            raise Requeue("kill_switch", f"the kill switch {p.stop.kill_path} is set: not training")
        if world.rank == 0:
            dump_config(self.cfg, Path(run_dir) / "config.toml")
        # a host is its SLURM node name under SLURM (what --exclude and ExcNodeList take), else its hostname
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        p.inprocess.open_snapshots()  # a sharded model's snapshot copies: a group of their own
        ports = sever.listening_ports() if p.rejoin.active else []
        gathered = tgdist.gather_objects((host, ports))
        hosts = world.hosts = [h for h, _ in gathered]
        p.rejoin.group_ports = {port for _, ports in gathered for port in ports}  # cut on a lost peer (rejoin.sever)
        p.recovery.on_start()
        resumed = p.resumer.resume()
        resumed_from = None
        if resumed is not None:
            world.step, resumed_from = resumed.step, resumed.checkpoint
            if p.heartbeat is not None:
                p.heartbeat.resumed(world.step)
            if resumed.persistent is not None:
                p.recovery.on_resume(resumed.persistent)
        p.call("begin", world.step)  # the component protocol: the replicas agree here, the boundary kept
        p.progress.began(world.step)  # the launcher hears of the first completed step (the progress rule)
        p.inprocess.snapshot(world.step, now=True)  # a sharded model's first in-memory snapshot
        world.ping = health.start(
            self.cfg.health,
            p.store,
            self.cfg.checkpoint.keep_last,
            self.model,
            self.optimizer,
            p.events,
            world.step,
            hosts,
            world.rank,
            world.world_size,
            self.on_ping_failure,
        )
        if world.rank == 0:
            p.events.emit(
                "start",
                world.step,
                world_size=world.world_size,
                host=socket.gethostname(),
                first_step=world.step,
                resumed_from=str(resumed_from.path) if resumed_from else None,
            )
            how = (
                f"resumed at step {world.step} from {resumed_from.path}"
                if resumed_from
                else "fresh start (no checkpoint)"
            )
            console.say(f"run {run_dir}: {how}, {world.world_size} rank(s)")
        started = time.perf_counter()
        self.ctx.tell_hooks("on_train_begin")
        return resumed_from, started

    def finish(self, last_loss: Any) -> str:
        """End training (see :meth:`~.guard.Guard.finish`); a collective. ``last_loss``: the last
        step's loss (tensor, float or ``None``), for the ``end`` event.

        Returns:
            The SHA-256 of the model and optimizer state (hex), as the ``end`` event carries it.
        Raises:
            GiveUp: ``[checkpoint] max_failures`` saves in a row failed.
        """
        p, world = self.p, self.world
        p.inprocess.close_snapshots()
        if p.rejoin.failure is not None:  # lost after the last step's update (a framework's loop)
            p.recovering.recover(redo=False)
        p.sdc_flow.settle_pending()  # the last step's replica check: no next bucket carries it
        if self.cfg.checkpoint.save_final:
            p.stops.save("final")
        p.commits.saved(p.ckpt.close())
        digest = state_hash(self.model, self.optimizer)
        loss = float(last_loss.detach() if torch.is_tensor(last_loss) else last_loss) if last_loss is not None else None
        if world.rank == 0:
            p.events.emit("end", world.step, state_sha256=digest, last_loss=loss)
            console.say(f"finished at step {world.step}; state sha256 {digest}")
        # leave together: a rank that tears its group down while a peer still finishes rank-0
        # work (the final commit) can make gloo abort in the peer at exit
        world.stop_ping()
        tgdist.barrier()
        enter_teardown(p.heartbeat)
        self.ctx.tell_hooks("on_train_end", "finished")
        return digest
