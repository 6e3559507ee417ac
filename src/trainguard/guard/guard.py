"""The Guard: a plain PyTorch loop gains resume, scheduled and emergency saves, and clean stops.

::

    with trainguard.Guard(cfg, model=model, optimizer=opt, scheduler=sched, sampler=sampler) as guard:
        for step in guard.steps(max_steps):      # resumes from the newest valid checkpoint
            loss = train_step(batch_for(step))
            guard.step_end(loss=loss)            # saves on schedule, stops on signal/switch/time

**Step numbers.** ``guard.step`` counts completed steps. ``steps()`` yields the 0-based index of
the step about to run, which equals ``guard.step``; that step's *number* is ``guard.step + 1``
(1-based: step number N is the N-th optimizer step). Events about a step in progress (instability,
out of memory, injected faults) carry its number; a checkpoint "at step N" holds the state after N
completed steps, and resuming from it yields N next.

At each step boundary (``step_end``), on every rank, the step is counted and timed; about once a
second the stop flags of all ranks are combined in one all-reduce (:class:`~.stop_check.StopCheck`),
so all ranks decide alike at the same step; a stop saves and raises
:class:`~trainguard.outcomes.Requeue` (exit code 75); the checkpoint interval or a save switch
saves and training goes on (docs/guard.md, "The step boundary"). When ``steps()`` runs out the
Guard saves the final state and writes an ``end`` event carrying the SHA-256 of the state.

**Outcomes.** Components raise typed outcomes (:mod:`trainguard.outcomes`: ``Requeue``,
``GiveUp``, ``BadInput``, each carrying its exit code) or return decisions (a rollback);
the Guard's public methods are the edge: on an outcome they print one line, write the ``exit``
event, release what the Guard installed and let the outcome propagate, so an uncaught one ends the
script with its code. On ``Requeue`` and ``GiveUp`` (which every rank raises at the same step) the
ranks also leave together and destroy the default process group: a gloo group torn down during
interpreter exit can abort the process, which the launcher would read as a crash.

**Lifetime.** Everything the Guard installs — signal handlers, optimizer and gradient hooks, the
liveness-ping, checkpoint-writer and deleter threads, their process groups, the heartbeat record —
is released by :meth:`Guard.close` (or leaving ``with Guard(...)``); closing twice is harmless.
So is every process-wide patch it makes: ``clip_grad_norm_`` (the norm noted for ``should_step``),
``sys.excepthook`` (a lost peer told in one line), and with in-process recovery on more than one
rank ``torch.distributed``'s collectives, ``Tensor.backward`` and DDP's communication hook
(:mod:`trainguard.rejoin.catch`).

**Components.** The Guard builds its parts in order, each from its config section, the run's
:class:`.context.Context` and the parts it acts on (:func:`.build.build`; ``guard.ckpt``,
``guard.events``, ... are read-only views of :class:`.parts.Parts`). Each part is registered as
it is built and may implement the points of one protocol (:class:`.context.Component`: ``begin``,
``step_begin``, ``should_step``, ``step_end``, ``close``), called in registration order and closed
in reverse. The decisions between parts are made by two orchestrators, the start and end of
training (:mod:`.lifecycle`) and the step's opening, update check and boundary (:mod:`.boundary`),
over the flows they call: stop and save (:mod:`.saving`), the replica check's flow
(:mod:`.sdc_flow`), rollbacks (:mod:`.rollback`), in-process recovery (:mod:`.inprocess`, and the
Guard's side of it, :mod:`.recovering`); they share one view of where this rank stands (:class:`.world.World`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from .. import console
from .. import dist as tgdist
from ..checkpoint.store import Checkpoint
from ..config import Config, ConfigError, config_from_argv, load_config
from ..events import Hook
from ..outcomes import BadInput, Outcome, exit_bad_input
from ..rejoin.protocol import is_peer_failure
from ..rejoin.regroup import RecoveryRefused
from ..state.reshard import rank_batch
from ..supervisor.rank import enter_teardown
from . import build, edge, live, parts, wrappers
from .context import Script
from .parts import Parts
from .recovering import Caught
from .world import World


class Guard:
    """Fault tolerance for one training process (one rank).

    Args:
        config: validated :class:`~trainguard.config.Config` (or a subclass).
        model: the module being trained (DDP/FSDP-wrapped or plain). A framework's wrappers of the
            model, optimizer and scheduler (Lightning Fabric's, accelerate's) are unwrapped
            (:mod:`.wrappers`).
        optimizer, scheduler: optional; saved and restored with the model.
        sampler: optional data position; any object with ``state_dict()``/``load_state_dict()``
            such as :class:`~trainguard.sampler.ResumableSampler`.
        extra_state: more ``{name: stateful}`` objects to save (a GradScaler, say; their state
            must load with ``weights_only=True``). In-process recovery treats them as this rank's own
            state: a replacement takes them from the lost rank's step boundary.
        shared_state: as ``extra_state``, for state every rank holds alike (a framework's loop
            counters): a replacement of a lost rank takes it from a survivor, as it is at that
            moment (:mod:`trainguard.lightning`'s loop progress).
        hooks: :class:`~trainguard.events.Hook` instances.
        checkpoint_files: ``write(directory)``, called on every rank inside each persistent save
            before the commit: the files it writes there are checksummed and committed with the
            checkpoint (a framework's own checkpoint files: :mod:`trainguard.hf`). Saves are then
            blocking (``[checkpoint] async_save = "auto"`` or ``false``; ``true`` is refused).
        redo_in_step: a framework's loop, which cannot yield a step again (:mod:`trainguard.lightning`,
            :mod:`trainguard.hf`): a peer lost in a step is recovered inside the next one, at
            :meth:`recover_in_step`, also when the step's update was applied (until then the
            collectives of its end and of the framework's work between steps, such as validation,
            complete on this rank alone: a replacement joining between steps would not run them).
        framework: a framework that drives the loop and owns the process group, and whose loop
            in-process recovery does not cover (``"the Hugging Face Trainer"``): a lost rank restarts
            the group, and rank 0 says so once at start.

    Create it after ``torch.distributed.init_process_group`` (if distributed).

    Raises:
        BadInput: a framework's wrapper the Guard cannot take (:mod:`.wrappers`), an unwritable
            run dir or local checkpoint dir, ``checkpoint_files`` with
            ``[checkpoint] async_save = true``, ``[rollback] skip_batches`` without a sampler
            that can skip (the message is printed first; see :func:`.build.build`), or another
            Guard of this process still training (:mod:`.live`).
        Any error that leaves the constructor leaves nothing of the Guard installed.
    """

    def __init__(
        self,
        config: Config,
        *,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        scheduler: Any = None,
        sampler: Any = None,
        extra_state: Optional[dict[str, Any]] = None,
        shared_state: Optional[dict[str, Any]] = None,
        hooks: tuple[Hook, ...] | list[Hook] = (),
        checkpoint_files: Optional[Callable[[Path], None]] = None,
        redo_in_step: bool = False,
        framework: Optional[str] = None,
    ):
        model, optimizer, scheduler, sampler, framework = wrappers.unwrap(
            model, optimizer, scheduler, sampler, framework
        )
        self.cfg = config
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.extra_state, self.shared_state = dict(extra_state or {}), dict(shared_state or {})
        self.hooks: list[Hook] = list(hooks)
        self.world = World(tgdist.rank(), tgdist.world_size())
        self.run_dir = Path(config.run.dir)
        self.resumed_from: Optional[Checkpoint] = None
        self.state_sha256: Optional[str] = None
        self.parts = Parts()  # filled in order by build.build; close() releases those that were built
        self._closed = False
        self.finished = False  # training ended (finish()): a new Guard of this process may take over (.live)
        self.training = False  # begin() ran and finish() did not: a second Guard of this process is refused
        self._edge = edge.Edge(self._leave)  # carries out an outcome once (see "Outcomes")
        given = (model, optimizer, scheduler, sampler, self.extra_state, self.shared_state, self.hooks)
        script = Script(*given, checkpoint_files, redo_in_step, framework)
        try:
            with self._edge():  # the Guard is the owner the hooks receive
                live.claim(self)
                build.build(self.parts, config, self.world, script, self, self.section)
        except BaseException:  # whatever left build(): nothing it installed stays behind
            self._release(collective=False)
            console.restore_excepthook()
            raise

    # the shared view, as the Guard's public attributes
    step = property(lambda self: self.world.step, lambda self, v: setattr(self.world, "step", v))
    rank = property(lambda self: self.world.rank, doc="This process's rank (a shrink or growth renumbers it).")
    world_size = property(lambda self: self.world.world_size, doc="The group's size now.")
    hosts = property(lambda self: self.world.hosts, doc="Every rank's host (index = rank), from the start.")
    ping = property(lambda self: self.world.ping, doc="The liveness ping of the current group, or ``None``.")
    last_loss = property(
        lambda self: self.boundary.last_loss if self.boundary else None, doc="The last counted step's loss, as given."
    )

    def section(self, name: str) -> contextlib.AbstractContextManager[None]:
        """``with guard.section("eval"): ...``: a named section the hang supervisor times (and learns)."""
        return self.heartbeat.section(name) if self.heartbeat is not None else contextlib.nullcontext()

    def recoverable(self, where: str) -> Caught:
        """``with guard.recoverable("backward") as lost: ...``: for an integration's own call into
        the step (a framework's training step): a lost peer there under in-process recovery is
        recorded at ``where`` in the step in progress and ends the block, ``lost`` then true (the
        step is done again after the recovery); any other error propagates."""
        return self.recovering.recoverable(where, self.world.step + 1)

    @property
    def in_process(self) -> bool:
        """Whether in-process recovery is on for this run (``[recovery] in_process``, under
        ``trainguard run``, not declined for this loop)."""
        return self.rejoin.active

    @property
    def joining(self) -> bool:
        """Whether this process is the replacement of a lost rank (or a newcomer) that joins the
        survivors at :meth:`begin` instead of resuming from a checkpoint."""
        return self.rejoin.joining

    def release_step(self) -> None:
        """After :meth:`should_step` returned ``False``: let ``optimizer.step()`` run in this step,
        for a framework that calls it whatever a callback decided (the Hugging Face Trainer). Set
        the gradients to ``None`` first, so that torch's optimizers leave the parameters alone."""
        self.recovery.release()

    def take_back_signals(self) -> None:
        """Install the Guard's signal handlers again over a framework's, put in place after the
        Guard (Lightning's at the start of ``fit``); :meth:`close` still restores the ones found first."""
        self.shutdown.take_back()

    @classmethod
    def from_config(
        cls,
        path: str | os.PathLike | None = None,
        *,
        overrides: Optional[list[str]] = None,
        schema: type[Config] = Config,
        **kwargs: Any,
    ) -> Guard:
        """Build a Guard from a TOML file (or, with ``path=None``, from the script's ``--config``/``--set``
        arguments and the launcher's environment).

        Raises:
            BadInput: a config error (printed first).
        """
        try:
            cfg = load_config(path, overrides, schema) if path else config_from_argv(schema)
        except ConfigError as e:
            exit_bad_input(str(e))
        return cls(cfg, **kwargs)

    def rank_batch(self, batch: int) -> int:
        """The batch this rank trains per step, given the per-rank ``batch`` the script configures
        for the world size the run started with (``[elastic] keep``, see :mod:`trainguard.state.reshard`);
        ``batch`` itself until the world size changes. Call it inside the loop.

        Raises:
            BadInput: ``keep = "global_batch"`` and the global batch does not divide by the world size.
        """
        with self._edge():
            return rank_batch(batch, self.cfg.elastic.keep, self.elastic.base_world_size, self.world_size)

    # ------------------------------------------------------------------------------------------
    # the loop

    def steps(self, max_steps: int) -> Iterator[int]:
        """Yield step indices from the resumed step up to ``max_steps - 1`` (see "Step numbers").

        Call :meth:`step_end` once per yielded step. (A framework's loop, which calls back rather
        than iterating, uses :meth:`begin`, :meth:`step_begin` and :meth:`finish` instead.)

        Raises:
            Requeue: the kill switch was set before training (exit code 75).
            BadInput: ``checkpoint.interval`` > ``max_steps`` without ``save_final``, a checkpoint
                that does not fit, a failed preflight check (exit code 2).
        """
        self.begin(max_steps)
        while self.step < max_steps:
            self.step_begin()
            yield self.step
            self.boundary.between()  # step_end was called; no random numbers drawn outside the step
        self.finish()

    def begin(self, max_steps: int) -> int:
        """Start training (what ``steps()`` does before its first step): resume from the newest
        valid checkpoint, start the liveness ping, write the ``start`` event. For loops driven by a
        framework's callbacks (:mod:`trainguard.lightning`, :mod:`trainguard.hf`); a collective.

        Args:
            max_steps: the step count the run trains to (fault injection and the save-interval
                check read it).
        Returns:
            The index of the first step to run (the resumed step; 0 on a fresh start).
        Raises:
            as :meth:`steps`.
        """
        with self._edge():
            self.resumed_from, started = self.lifecycle.begin(max_steps)
            self.boundary.timed_from(started)
        self.training = True
        return self.step

    def step_begin(self) -> None:
        """Open the step about to run (what ``steps()`` does before each yield): the hang
        supervisor times it in the ``step`` section (the first step stays in ``setup``). Call
        :meth:`step_end` to close it."""
        self.boundary.open()

    def finish(self) -> None:
        """End training (what ``steps()`` does after its last step): the final save (``[checkpoint]
        save_final``), the ``end`` event with the state's SHA-256 (``guard.state_sha256``), and all
        ranks leave together; a collective.

        Raises:
            GiveUp: ``[checkpoint] max_failures`` saves in a row failed.
        """
        with self._edge():
            self.state_sha256 = self.lifecycle.finish(self.last_loss)
        self.finished, self.training = True, False

    def should_step(self, loss: Any, grad_norm: Any = None) -> bool:
        """Check the step for instability after ``backward()``; apply it only if this returns ``True``::

            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if guard.should_step(loss, grad_norm):
                optimizer.step()
                scheduler.step()
            guard.step_end(loss=loss)

        Runs the ``[instability]`` detectors (non-finite loss or gradients, loss and gradient-norm
        spikes) with one all-reduce and one device→host sync, and acts on every rank alike: ``False``
        after a skip (gradients zeroed) or a rollback (state reloaded from a known-good checkpoint;
        the next yielded step is the checkpoint's). With ``[sdc] on_instability = "rerun"`` an
        unstable step is first done again: ``False``, and ``steps()`` yields the same step, whose
        batch and random numbers come back (see :mod:`trainguard.sdc.rerun`). A collective: call it
        on every rank.

        Args:
            loss: this rank's loss (0-dim tensor or float).
            grad_norm: the total gradient norm (e.g. ``clip_grad_norm_``'s return value); ``None``:
                the norm that ``torch.nn.utils.clip_grad_norm_`` returned in this step if it ran
                once (the Hugging Face Trainer's), else computed here from the model's gradients
                with fused ops.
        Raises:
            GiveUp: ``raise`` policy, no checkpoint to roll back to, rollback budget spent (exit 76).
            ValueError: a hook's ``on_instability`` returned an unknown action.
        """
        with self._edge():
            return self.boundary.should_step(loss, grad_norm)

    def recover_in_step(self) -> bool:
        """For a framework's loop, which cannot yield a step again: if a peer was lost in the step in
        progress before its update was applied, meet the lost rank's replacement now and return
        ``True``: the caller runs the step's forward and backward again, on the same batch (the
        random number generators and this rank's own state are back at the step's start), then
        calls :meth:`should_step` again and applies the update as usual. ``False``: no peer was
        lost (or the update was already applied: :meth:`step_end` recovers). A collective on the
        new group. Used by :mod:`trainguard.lightning` after :meth:`should_step` returned ``False``.

        Raises:
            RegroupError, the collective's error: the ranks cannot be recovered in-process (no new
                generation within ``[recovery] timeout``, DDP survivors one step apart: this rank
                exits and the launcher restarts the group; a sharded model rolls back to a snapshot
                instead).
        """
        if self.rejoin.failure is None or (self.step_start is not None and self.step_start.applied):
            return False
        with self._edge():
            self.recovering.recover(redo=True, take_completed=False)
        return True

    def catch_peers(self) -> None:
        """A replacement of a lost rank catches lost peers in the script's collectives from now on
        (by default from its first :meth:`step_begin`: the set-up collectives a framework runs after
        :meth:`begin` complete on it alone). For a framework whose first collective of a step
        comes before its step-begin callback (:mod:`trainguard.hf`: the token count's all-gather).
        Does nothing on other ranks."""
        self.recovering.catch_peers()

    def run_step(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        backward: Optional[Callable[[torch.Tensor], None]] = None,
    ) -> torch.Tensor:
        """Forward and backward of this step over micro-batches, recovering from out-of-memory::

            loss = guard.run_step(lambda mb: F.cross_entropy(model(mb[0]), mb[1]), (x, y))

        ``step_fn(micro_batch)`` runs the forward and returns the micro-batch's mean loss (0-dim);
        the Guard runs ``backward(loss × share of the batch)`` (default ``Tensor.backward``; pass
        e.g. ``lambda l: scaler.scale(l).backward()`` for AMP). Gradients must be zero (or ``None``)
        on entry. On out-of-memory on any rank every rank halves the micro-batch and retries the
        same batch (see :mod:`trainguard.oom` and ``[oom]``). A collective: call it on every rank.

        Args:
            batch: a tensor, or tuples/lists/dicts of tensors sharing their first (sample) dimension.
        Returns:
            The batch's loss (0-dim, detached).
        Raises:
            BadInput: a batch that cannot be split, a micro-batch size larger than the batch.
            GiveUp: out of memory at micro-batch size 1.
        """
        self.boundary.ran_step()
        with self._edge(), self.recovering.recoverable("run_step", self.step + 1):
            return self.micro.run(self.step + 1, step_fn, batch, backward)
        return torch.full((), float("nan"))  # a lost peer: the step is abandoned and done again

    def step_end(self, loss: Any = None) -> None:
        """Close the current step: count it, then check stop and save conditions (see module doc).

        Args:
            loss: the step's loss (tensor or float), kept as ``guard.last_loss`` and passed to hooks;
                it is not synchronized here.
        Raises:
            Requeue: a stop was agreed (after the checkpoint of this step).
            GiveUp: ``[checkpoint] max_failures`` saves in a row failed.
            PeerLostError: a peer stopped answering the liveness ping.
        """
        with self._edge():
            self.boundary.close(loss)
            # the first step after an in-process recovery: tell the launcher (the progress rule)
            self.progress.step_completed(self.step, self.rank, self.world_size)
        self.draws.boundary()

    # ------------------------------------------------------------------------------------------
    # leaving: an outcome carried out once (self._edge), close

    def _leave(self, o: Outcome) -> None:
        """Carry out outcome ``o`` (once, from :class:`~.edge.Edge`): alone (bad input, a rank
        that withdraws) without waiting for a peer; else finish the save in flight, tell the hooks,
        write the ``exit`` event and leave together."""
        if isinstance(o, BadInput) or not o.collective:  # found on this rank only: no collective
            edge.announce(o, self.rank, self.step, self.events)
            if not isinstance(o, BadInput):
                enter_teardown(self.heartbeat)
            self._release(collective=False)
            if not isinstance(o, BadInput):  # the others carry on without this rank
                tgdist.destroy()  # a gloo group torn down during interpreter exit can abort the process
            return
        if self.commits is not None:
            self.commits.wait()
        for h in self.hooks:
            h.on_train_end(self, o.reason)
        edge.announce(o, self.rank, self.step, self.events)
        enter_teardown(self.heartbeat)
        # the process leaves: skip the final collection over torch objects at its exit (measured:
        # 0.6 s -> 0.1 s); at exit only, so a notebook that catches the outcome has nothing frozen
        atexit.register(gc.freeze)
        self.world.stop_ping()
        tgdist.barrier()  # leave together, then tear the default group down before the interpreter exits
        self.close()
        tgdist.destroy()

    def close(self) -> None:
        """Release everything the Guard installed: finish a save in flight, stop the liveness ping
        (agreeing with the other ranks: call ``close`` on every rank, as the loop does) and the
        checkpoint threads, destroy their process groups, remove optimizer and gradient hooks,
        restore the previous signal handlers, unmap the heartbeat record, close the event log.
        Safe to call twice; ``with Guard(...) as guard:`` calls it."""
        console.restore_excepthook()  # also after a failure's release, which keeps it for the error
        if self._closed:
            return
        self._closed = True
        if self.commits is not None:  # (built after the checkpointer)
            self.commits.saved(self.ckpt.close())
        self.world.stop_ping()
        self._release(collective=True)

    def _release(self, collective: bool) -> None:
        """The local part of closing (no collective): hooks, signal handlers, threads that need no
        peer, heartbeat, event log. ``collective=False`` (a failure on this rank alone) does not
        wait for a background save, which may be waiting for peers."""
        self._closed = True
        self.parts.release(collective)
        live.release(self)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None or (isinstance(exc, Outcome) and exc.collective):
            self.close()
        else:  # a crash: the peers may not come to a collective
            if self.parts.jit is not None and is_peer_failure(exc):  # the group restarts: save what it resumes from
                self.parts.jit.save("this rank lost a peer")
            elif self.parts.jit is not None and isinstance(exc, RecoveryRefused):  # refused, nothing touched
                self.parts.jit.save(f"in-process recovery refused on this rank: {exc}")
            self.abandon()

    def abandon(self) -> None:
        """After a crash on this rank (an error that is not a trainguard outcome): release what the
        Guard installed without a collective (the peers may not come to one) and without waiting
        for a background save. :meth:`close` afterwards puts back ``sys.excepthook`` (kept for the
        error on its way out)."""
        self._release(collective=False)

    # ------------------------------------------------------------------------------------------
    # saving and stopping (self.stops)

    def rank_state(self) -> dict[str, Any]:
        """This rank's non-tensor training state: ``{"step": ..., **train_state}`` (scheduler, data
        position, extras, instability statistics and learning-rate ramp, micro-batch size, RNG)."""
        return self.stops.rank_state()

    def save(
        self, reason: str = "manual", tiers: tuple[str, ...] = ("persistent",), blocking: bool = True
    ) -> Optional[Checkpoint]:
        """Save a checkpoint of the current step (a collective: call on every rank).

        Does nothing for a tier that already holds this step. A failed write is recorded as a
        ``checkpoint_failed`` event and a warning; the older checkpoints stay valid.

        Args:
            tiers: ``"persistent"`` and/or ``"local"``.
            blocking: ``False`` with ``[checkpoint] async_save``: return once the state is copied
                to host memory; the write and commit finish in the background.
        Returns:
            The committed persistent checkpoint of a blocking save, else ``None``.
        Raises:
            GiveUp: ``[checkpoint] max_failures`` failures in a row (exit 76).
        """
        with self._edge():
            return self.stops.save(reason, tiers, blocking)


def _part(name: str) -> property:
    return property(lambda self: getattr(self.parts, name), doc=f"The Guard's ``{name}`` (:class:`.parts.Parts`).")


for _name in parts.NAMES:  # guard.ckpt, guard.events, ...: read-only views of the parts
    assert not hasattr(Guard, _name), _name  # a part never hides one of the Guard's own names
    setattr(Guard, _name, _part(_name))
