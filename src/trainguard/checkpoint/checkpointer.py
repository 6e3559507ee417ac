"""The Guard's checkpointing: when to save, to which tier, synchronously or in the background, and
where to resume from.

Two tiers (``[checkpoint]`` and ``[checkpoint.local]``): the persistent store (sharded DCP files on
the shared filesystem, every ``interval`` steps) and the optional node-local tier (one file per rank,
every ``local.interval`` steps, replicated; see :mod:`trainguard.checkpoint.local`).

Asynchronous saves (``async_save``): at the step boundary the module buffers and the rank state
are copied at once into reused host buffers (:class:`~trainguard.checkpoint.snapshot.Snapshot`);
one background thread then copies the parameters and optimizer states (while the next forward and
backward run: they only read them; an optimizer step pre-hook waits for the copy before the step
changes them, as torchtitan overlaps its staging), writes the copy and runs the commit protocol on
a process group of its own. Contract: between a save and the next ``optimizer.step()``, parameters
and optimizer states are changed only by that step (no in-place edits of ``param.data``). A checkpoint is committed (visible to ``latest_valid()``) only after every rank's files are
durable and all ranks agreed, exactly as for a synchronous save. The next save first waits for the
previous one, so at most one is in flight and its buffers are never overwritten while written.

Failures (ENOSPC, EIO, ...) of either tier: the commit does not happen, the older checkpoints stay,
a ``checkpoint_failed`` event and a warning name the error. Every rank learns the same result (the
protocol broadcasts it), and the decision to stop after ``max_failures`` consecutive failures is
taken when the next save begins (the same step on every rank): :meth:`Checkpointer.check_failures`
raises :class:`~trainguard.outcomes.GiveUp` (exit 76), instead of training on without checkpoints.

The Checkpointer knows the model, the optimizer, the store and the event log, nothing else: the
Guard hands it each save's rank state, and acts on the :class:`SaveResult` it returns (the
known-good bookkeeping, retention through :meth:`Checkpointer.retain`, the hooks).
"""

from __future__ import annotations

import copy
import errno
import logging
import shutil
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from .. import compat, console
from .. import dist as tgdist
from ..atomic import write_atomic
from ..events import EventLog
from ..health.preflight import PreflightError, check_writable, state_bytes
from ..outcomes import BadInput, GiveUp
from ..ranks import RankView
from ..rundir import replaceable
from ..sections import CheckpointSection
from . import CheckpointMismatchError, CheckpointStore, check_compatible, jit, load_state, loadable
from . import manifest as mf
from .io import apply_state, model_optim_state, saved_world_size, write_checkpoint
from .local import LocalTier, choose, deserialize, expand_dir
from .snapshot import Snapshot, copy_pairs
from .store import Checkpoint

log = logging.getLogger(__name__)

# in the error of a background save refused because its sources changed during the copy; every rank
# gets the same error, so all turn to synchronous saves at once (Checkpointer._finalize)
CHANGED_DURING_COPY = "changed in place during the background copy"

# Before the first save is measured, assume this write speed to estimate the save time (bytes/s);
# a conservative figure for a shared filesystem.
ASSUMED_WRITE_BPS = 100e6


@dataclass
class SaveResult:
    """The outcome of one save (all ranks get the same ``error``).

    ``blocked_seconds``: how long training waited (the snapshot, or the whole synchronous write);
    ``write_seconds``: from the start of the write to the commit.
    """

    step: int
    reason: str
    tiers: tuple[str, ...]
    asynchronous: bool
    checkpoint: Optional[Checkpoint] = None
    bytes: int = 0
    local_bytes: int = 0
    error: Optional[str] = None
    blocked_seconds: float = 0.0
    write_seconds: float = 0.0
    started: float = 0.0  # Unix time the save began (training blocked from here for blocked_seconds)


@dataclass
class ResumePoint:
    """Where a run resumes: the persistent ``checkpoint``, or a local-tier ``step`` with its ``plan``."""

    tier: str
    step: int
    checkpoint: Optional[Checkpoint] = None
    plan: Optional[list[int]] = None


class Checkpointer:
    """Saving and resuming for one rank.

    Args:
        cfg: the ``[checkpoint]`` section.
        run_dir: the run directory (``cfg.dir`` is relative to it unless absolute).
        events: the rank's event log.
        model, optimizer: what is saved through DCP (the optimizer may be ``None``).
        world: this rank and the group size, read at each use (:class:`~trainguard.ranks.RankView`:
            the Guard's shared world, which a shrink changes; the local tier takes them at construction).
        node_rank, local_world_size: this node's index and its number of ranks (the local tier's
            ``{node}`` and its replication peer); ``local_world_size`` ``None``: the world size.
        background: whether scheduled saves may be written in the background (``None``:
            ``cfg.async_save`` is not ``False``); :attr:`asynchronous` turns false for good once a
            background copy saw its sources changed (see :data:`CHANGED_DURING_COPY`).
        write_files: ``write(directory)``: more files for each persistent checkpoint, written on
            every rank into its temporary directory before the commit (a framework's own; blocking saves).
    Raises:
        BadInput: ``[checkpoint.local] dir`` is not a writable directory, or another user could
            replace it or a directory above it (:func:`~trainguard.rundir.replaceable`).
    """

    def __init__(
        self,
        cfg: CheckpointSection,
        run_dir: Path,
        events: EventLog,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        world: RankView,
        node_rank: int = 0,
        local_world_size: Optional[int] = None,
        background: Optional[bool] = None,
        write_files: Optional[Callable[[Path], None]] = None,
    ):
        self.cfg, self.events, self.model, self.optimizer = cfg, events, model, optimizer
        self.world = world
        rank, world_size = world.rank, world.world_size
        root = Path(cfg.dir)
        self.store = CheckpointStore(
            root if root.is_absolute() else run_dir / root, keep_last=cfg.keep_last, on_invalid=self._on_invalid
        )
        self.jit = jit.JitStore(self.store.root / jit.DIRNAME)  # a group restart's copies (checkpoint.jit)
        self.local: Optional[LocalTier] = None
        if cfg.local.dir is not None:
            base = expand_dir(cfg.local.dir, rank, node_rank)
            why = replaceable(base.absolute())  # before anything is made there (issue 54)
            if why:
                raise BadInput(
                    f"checkpoint.local.dir {base}: {why}; another user could swap the checkpoints it holds "
                    "(loaded at a resume). Use a directory of your own"
                )
            try:
                check_writable(base, "checkpoint.local.dir")
            except PreflightError as e:
                raise BadInput(str(e)) from None
            run_id = _run_id(run_dir, rank)  # runs sharing a node-local directory keep apart
            self.local = LocalTier(
                base / run_id,
                self.store.root / "local-replicas" if cfg.local.replicate else None,
                cfg.local.keep_last,
                rank,
                world_size,
                local_world_size or world_size,
                run_id,
                self._on_invalid,
            )
        background = cfg.async_save is not False if background is None else background
        self.asynchronous = background  # scheduled saves go to the background (see save(blocking=False))
        self.group = tgdist.new_cpu_group() if (background or self.local is not None) else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="trainguard-ckpt") if background else None
        if self.pool is not None:  # its thread starts now: a save must not need a new thread (an address-space limit)
            self.pool.submit(lambda: None)
        self.deleter: Optional[ThreadPoolExecutor] = None  # deletes what retention set aside
        self.snapshot = Snapshot()
        self._copied: Optional[threading.Event] = None  # set once the background copy of the state is done
        self._copy_wait = 0.0  # seconds the optimizer step waited for that copy (part of the blocked time)
        self._hook = (
            optimizer.register_step_pre_hook(self._before_optimizer_step)
            if background and optimizer is not None
            else None
        )
        self.pending: Optional[Future] = None
        self._pending_step = 0
        self.failures = 0  # consecutive failed saves
        self.last_error: Optional[str] = None
        self.saved: dict[str, int] = {}  # tier -> last step saved (or being saved)
        self.save_seconds: Optional[float] = None  # last measured synchronous write time
        self.state_bytes_guess = state_bytes(model, optimizer)  # for the save-time guess
        # more files for each persistent checkpoint, written on every rank into its temporary
        # directory before the commit (see write_checkpoint); blocking saves only
        self.write_files = write_files
        self.proven = False  # a save of this process was checked loadable (loadable.py): once is enough

    # ------------------------------------------------------------------------------------------
    # saving

    def due(self, step: int) -> tuple[str, ...]:
        """The tiers whose interval ends at ``step``."""
        tiers = ("persistent",) if step % self.cfg.interval == 0 else ()
        if self.local is not None and step % self.cfg.local.interval == 0:
            tiers += ("local",)
        return tiers

    def save(
        self, step: int, reason: str, tiers: tuple[str, ...], rank_state: dict[str, Any], blocking: bool = True
    ) -> Optional[SaveResult]:
        """Save step ``step`` to ``tiers`` (a collective: every rank calls it at the same step).

        Call :meth:`wait` first (the previous save's result is the caller's to act on).
        ``blocking=False`` with ``async_save`` returns after the snapshot (``None``; the result is
        finalized later by :meth:`poll` or :meth:`wait`).

        Args:
            step: steps completed (the checkpoint's step).
            reason: why (``interval``, ``signal``, ``final``...), recorded in the events.
            tiers: ``"persistent"`` and/or ``"local"``; a tier already holding ``step`` is skipped.
            rank_state: this rank's non-tensor state (copied here).
        Returns:
            The finalized result of a blocking save, or ``None`` (already saved, or in flight).
        """
        assert self.pending is None, "wait() for the previous save first"
        tiers = tuple(t for t in tiers if self.saved.get(t) != step and (t != "local" or self.local is not None))
        if not tiers:
            return None
        t0, started = time.perf_counter(), time.time()
        state = model_optim_state(self.model, self.optimizer)
        rank_state = copy.deepcopy(rank_state)
        meta = {"reason": reason, "trainguard_step": step, "world_size": self.world.world_size}
        for t in tiers:
            self.saved[t] = step
        if self.pool is not None and self.asynchronous and not blocking:
            defer = self._changes_only_in_step() if compat.has_tensor_version() else (lambda t: False)
            snap, deferred = self.snapshot.take(state, defer=defer)
            versions = [compat.tensor_version(src) for _, src in deferred]
            self._copied, self._copy_wait, self._pending_step = threading.Event(), 0.0, step
            blocked = time.perf_counter() - t0
            self.pending = self.pool.submit(
                self._write_async, deferred, versions, step, reason, tiers, snap, rank_state, meta, blocked, started
            )
            return None
        return self._finalize(self._write(step, reason, tiers, state, rank_state, meta, 0.0, started, False))

    def _changes_only_in_step(self) -> Callable[[torch.Tensor], bool]:
        """A predicate: does this tensor (by storage address) belong to a parameter or an optimizer
        state, i.e. change only inside ``optimizer.step()``? Without an optimizer: nothing is deferred."""
        opt = self.optimizer
        if opt is None:
            return lambda t: False
        ptrs = {_local(p).data_ptr() for group in opt.param_groups for p in group["params"]}
        ptrs |= {_local(v).data_ptr() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
        return lambda t: t.numel() > 0 and t.data_ptr() in ptrs

    def _write_async(self, deferred: list, versions: list[int], *args: Any) -> SaveResult:
        """The background save: copy the deferred tensors, check that none of them changed since the
        snapshot (its in-place version counter: any in-place op on the tensor or a view of it; an
        edit through ``.data`` is not counted), then write, refusing the commit if one did."""
        try:
            copy_pairs(deferred)
            changed = sum(compat.tensor_version(src) != v for (_, src), v in zip(deferred, versions))
        finally:
            self._copied.set()  # type: ignore[union-attr]
        refuse = (
            f"rank {self.world.rank}: {CHANGED_DURING_COPY} ({changed} of {len(deferred)} parameter and optimizer "
            "tensors were changed in place between the save and the next optimizer.step())"
            if changed
            else None
        )
        return self._write(*args, True, refuse)

    def _before_optimizer_step(self, *_: Any) -> None:
        """Optimizer step pre-hook: the background copy of parameters and optimizer states must be
        complete before the step changes them."""
        copied = self._copied
        if copied is not None and not copied.is_set():
            t0 = time.perf_counter()
            copied.wait()
            self._copy_wait += time.perf_counter() - t0

    def _write(
        self,
        step: int,
        reason: str,
        tiers: tuple[str, ...],
        state: dict,
        rank_state: dict,
        meta: dict,
        blocked: float,
        started: float,
        asynchronous: bool,
        refuse: Optional[str] = None,
    ) -> SaveResult:
        t0 = time.perf_counter()
        r = SaveResult(step, reason, tiers, asynchronous, started=started)
        errors = []
        if "local" in tiers:
            r.local_bytes, err = self.local.write(step, {**state, "rank": rank_state}, meta, self.group, refuse)  # type: ignore[union-attr]
            errors += [err] if err else []
        if "persistent" in tiers:
            try:
                r.checkpoint, r.bytes = write_checkpoint(
                    self.store, step, state, rank_state, meta, self.group, self.write_files, refuse
                )
            except OSError as e:
                errors.append(str(e))
        r.error = "; ".join(errors) or None
        r.write_seconds = time.perf_counter() - t0
        r.blocked_seconds = blocked if asynchronous else r.write_seconds
        return r

    def poll(self) -> Optional[SaveResult]:
        """At a step boundary: finalize a background save that has finished (no waiting)."""
        if self.pending is not None and self.pending.done():
            return self.wait()
        return None

    def wait(self) -> Optional[SaveResult]:
        """Block until the save in flight (if any) is committed or failed, and finalize it."""
        if self.pending is None:
            return None
        future, self.pending = self.pending, None
        try:
            result = future.result()
        except (
            Exception,
            CheckpointException,
        ) as e:  # an unexpected error in the writer: report it like a failed write
            result = SaveResult(self._pending_step, "unknown", (), True, error=f"{type(e).__name__}: {e}")
        result.blocked_seconds += self._copy_wait
        self._copied, self._copy_wait = None, 0.0
        return self._finalize(result)

    def _finalize(self, r: SaveResult) -> SaveResult:
        refused = r.error is not None and CHANGED_DURING_COPY in r.error
        if refused and self.asynchronous:
            self.asynchronous = False  # every rank learns the same error: all turn synchronous at once
            if self.world.rank == 0:
                console.warn(
                    f"checkpoint at step {r.step} not committed: {r.error}. The loop changes parameters or "
                    "optimizer states in place outside optimizer.step(); later saves are synchronous "
                    "(set [checkpoint] async_save = false to say so)"
                )
        if r.error is not None:
            self.failures += 1
            self.last_error = r.error
            for t in r.tiers:
                self.saved.pop(t, None)
            log.warning("checkpoint at step %d failed: %s", r.step, r.error)
            if self.world.rank == 0 and not refused:  # (a refused save was explained above)
                print(
                    f"trainguard: WARNING: checkpoint at step {r.step} failed ({self.failures} in a row): {r.error}",
                    file=sys.stderr,
                    flush=True,
                )
            self.events.emit(
                "checkpoint_failed",
                r.step,
                reason=r.reason,
                error=r.error[:2000],
                tiers=list(r.tiers),
                asynchronous=r.asynchronous,
                consecutive=self.failures,
            )
            return r
        self.failures = 0
        if not self.proven:  # the first commit of this process: would a resume load it? (BadInput if not)
            self.proven = True
            local = self.local.root if self.local is not None and r.local_bytes else None
            loadable.prove(r.step, r.checkpoint, local, self.model, self.optimizer, self.world.rank)
        if not r.asynchronous:
            self.save_seconds = r.write_seconds
        if r.checkpoint is not None:  # this rank's just-in-time copies of older steps will never be chosen
            self.jit.discard(self.world.rank, keep=r.step)
        if r.local_bytes and self.world.rank == 0:
            self.events.emit(
                "local_checkpoint_committed",
                r.step,
                bytes_per_rank=r.local_bytes,
                reason=r.reason,
                seconds=round(r.write_seconds, 4),
                blocked_seconds=round(r.blocked_seconds, 4),
                started=round(r.started, 3),
                asynchronous=r.asynchronous,
                replicated=self.local.replica is not None,
            )  # type: ignore[union-attr]
        return r

    def retain(self, r: SaveResult, protect: set[int]) -> list[int]:
        """After a persistent commit: apply retention (rank 0; never ``r``'s step nor ``protect``)
        and write the ``checkpoint_committed`` event. Returns the steps set aside for deletion."""
        if r.checkpoint is None or self.world.rank != 0:
            return []
        t0 = time.perf_counter()
        deleted = self.store.apply_retention(protect={r.checkpoint.step} | protect, remove=self._remove)
        r.blocked_seconds += time.perf_counter() - t0 if r.asynchronous else 0.0  # on the training thread
        self.events.emit(
            "checkpoint_committed",
            r.step,
            path=str(r.checkpoint.path),
            bytes=r.bytes,
            seconds=round(r.write_seconds, 4),
            blocked_seconds=round(r.blocked_seconds, 4),
            started=round(r.started, 3),
            asynchronous=r.asynchronous,
            reason=r.reason,
            deleted_steps=deleted,
        )
        return deleted

    def _remove(self, path: Path) -> None:
        """Delete a directory retention set aside (already renamed to ``.trash-``), in a thread of
        its own: neither the loop nor the next save's copy waits for it."""
        if self.deleter is None:
            self.deleter = ThreadPoolExecutor(1, thread_name_prefix="trainguard-ckpt-delete")
        self.deleter.submit(shutil.rmtree, path, ignore_errors=True)

    def check_failures(self, step: int) -> None:
        """Before a save (after :meth:`wait`, so every rank counts alike): stop after
        ``max_failures`` consecutive failed saves.

        Raises:
            GiveUp: ``checkpoint_failures`` (a ``checkpoint_give_up`` event from rank 0 first).
        """
        if not (self.cfg.max_failures and self.failures >= self.cfg.max_failures):
            return
        why = (
            f"{self.failures} checkpoint saves in a row failed (last: {self.last_error}); stopping instead of "
            f"training on without checkpoints (checkpoint.max_failures = {self.cfg.max_failures})"
        )
        if self.world.rank == 0:
            self.events.emit("checkpoint_give_up", step, reason=why, failures=self.failures)
        raise GiveUp("checkpoint_failures", why)

    def loaded(self, tier: str, step: int) -> None:
        """The run resumed or rolled back to ``step`` of ``tier``: no tier holds a newer step."""
        self.saved = {tier: step}

    def estimated_save_seconds(self) -> float:
        """Seconds a synchronous save should take: the last measured one, else a size-based guess."""
        if self.save_seconds is not None:
            return self.save_seconds
        return 1.0 + self.state_bytes_guess / ASSUMED_WRITE_BPS

    def local_path(self, step: int) -> Path:
        """This rank's own local-tier directory of ``step`` (the local tier must be configured)."""
        assert self.local is not None, "no local tier"
        return self.local.own.path_for(step)

    def discard_local_after(self, step: int, why: str) -> None:
        """Set aside every local copy (own and replicas) newer than ``step`` (after a rollback)."""
        self.jit.discard(self.world.rank, newer_than=step, why=why)
        if self.local is None:
            return
        for store in filter(None, (self.local.own, self.local.replica)):
            for c in store.committed():
                if c.step > step:
                    store.set_aside(c, why, kind="rolledback")

    def regroup(self) -> None:
        """After in-process recovery replaced the default group (which took the writer's group
        with it): create the writer's group again, at the point in the order where a starting
        Checkpointer creates it (a collective)."""
        if self.group is not None:
            self.group = tgdist.new_cpu_group()

    def close(self, wait: bool = True) -> Optional[SaveResult]:
        """Finish the save in flight (its result is returned), stop the writer and deleter threads
        and wait until they ended, remove the optimizer hook and destroy the writer's process
        group. Safe to call twice.

        ``wait=False`` (this rank failed alone): do not wait for a save in flight, which may be
        waiting for its peers; its thread is left to end with the process and its group is kept.
        With none in flight the writer's thread is joined all the same (it ends at once), and the
        deleter's always (a deletion waits for no peer).
        """
        result = self.wait() if wait else None
        idle = self.pending is None
        for pool in (self.pool, self.deleter):
            if pool is not None:
                pool.shutdown(wait=wait or idle or pool is self.deleter)
        self.pool = self.deleter = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.group is not None and (wait or self.pending is None):
            tgdist.destroy_group(self.group)
            self.group = None
        self.snapshot.release()
        return result

    # ------------------------------------------------------------------------------------------
    # resuming

    def find_resume(self) -> Optional[ResumePoint]:
        """The newest verified checkpoint across both tiers (a collective; same answer on every rank).

        Persistent checkpoints newer than the one found do not verify: they are set aside (kept,
        renamed) so their steps can be saved again. A checkpoint that cannot be read (a transient
        error that outlasted its retries, :class:`~trainguard.checkpoint.manifest.ReadError`) is
        neither: nothing is set aside and every rank raises.

        Raises:
            trainguard.checkpoint.manifest.ReadError: on every rank together (the launcher's
                restart tries again). A local step counts only if every rank can load
        its part (own copy or replica); a local copy that fails verification is reported as a
        ``checkpoint_invalid`` event and the next candidate is used.
        """
        found, error = None, None
        if self.world.rank == 0:
            try:
                self.store.clean_stale()
                found = self.store.latest_valid(self.cfg.verify)
                for c in self.store.committed():
                    if found is None or c.step > found.step:
                        self.store.set_aside(c, "does not verify (see the checkpoint_invalid event)")
            except OSError as e:  # a read that kept failing: every rank stops here together, nothing set aside
                error = f"{type(e).__name__}: {e}"
        found, error = tgdist.broadcast_object((found, error))
        if error is not None:
            raise mf.ReadError(errno.EIO, f"the checkpoint to resume from could not be chosen (rank 0): {error}")
        point = ResumePoint("persistent", found.step, found) if found is not None else None
        if self.local is not None:
            self.local.clean_stale()
            inventories = tgdist.gather_objects(self.local.inventory(self.cfg.verify))
            step, plan = choose(inventories)
            if step is not None and (point is None or step > point.step):
                point = ResumePoint("local", step, plan=plan)
        self.jit.of(self.world.rank).clean_stale()  # a copy cut short by a kill: its temporary directory
        mine = self.jit.steps(self.world.rank, self.cfg.verify, self.world.world_size)
        step = jit.choose(tgdist.gather_objects(mine))  # a group restart's just-in-time copies
        if step is not None and (point is None or step > point.step):
            point = ResumePoint("jit", step)
        # copies newer than where the run goes on belong to an abandoned trajectory (some rank had
        # none of their step): set aside, so a later restart never mixes them with newer ones
        newer = point.step if point is not None else 0  # (copies made for another world size stay untouched)
        if any(s > newer for s in mine):
            self.jit.discard(self.world.rank, newer_than=newer, why="not resumed from")
        return point

    def path_of(self, point: ResumePoint) -> Path:
        """The directory ``point`` loads this rank's state from."""
        if point.checkpoint is not None:
            return point.checkpoint.path
        if point.tier == "jit":
            return self.jit.path(self.world.rank, point.step)
        return self.local_path(point.step)

    def written_by(self, point: ResumePoint) -> int:
        """How many ranks wrote ``point`` (a local copy: always this world size, others are skipped)."""
        if point.tier == "persistent":
            return saved_world_size(point.checkpoint.path) or self.world.world_size  # type: ignore[union-attr]
        return self.world.world_size

    def load(self, point: ResumePoint, rank_state_of: Optional[int] = None) -> dict[str, Any]:
        """Load ``point`` into the model and optimizer (a collective); returns this rank's rank state
        (``rank_state_of``: that rank's, e.g. rank 0's after a world-size change).

        Raises:
            BadInput: the checkpoint does not fit the model or optimizer.
        """
        if point.tier == "persistent":
            path = point.checkpoint.path  # type: ignore[union-attr]
            try:
                check_compatible(path, self.model, self.optimizer)
            except CheckpointMismatchError as e:
                raise BadInput(str(e)) from None
            try:  # what the load itself would fail on, named (see loadable.py)
                loadable.check_persistent(path, self.model, self.optimizer, None, dtypes=False)
            except CheckpointMismatchError as e:
                raise BadInput(f"checkpoint {path} cannot be loaded into this model: {e}") from None
            return load_state(path, self.model, self.optimizer, rank_state_of)
        if point.tier == "jit":
            state = self.jit.load(self.world.rank, point.step)
            where = self.jit.path(self.world.rank, point.step)
        else:
            state = deserialize(self.local.fetch(point.step, point.plan, self.group))  # type: ignore[union-attr,arg-type]
            where = self.local.root  # type: ignore[union-attr]
        try:
            if point.tier == "jit":  # the module's own state dict (strict: names every key that differs)
                jit.apply(self.model, self.optimizer, state)
            else:
                loadable.check_names(self.model, set(state["model"]))
                apply_state(self.model, self.optimizer, state)
        except (KeyError, RuntimeError, ValueError) as e:  # CheckpointMismatchError is a ValueError
            raise BadInput(
                f"{point.tier} checkpoint at step {point.step} in {where} does not fit this model: "
                f"{str(e).splitlines()[0]}"
            ) from None
        return state["rank"]

    def _on_invalid(self, ckpt: Checkpoint, reason: str) -> None:
        tier = "persistent" if ckpt.path.parent == self.store.root else "local"
        self.events.emit("checkpoint_invalid", ckpt.step, path=str(ckpt.path), reason=reason, tier=tier)


def _run_id(run_dir: Path, rank: int) -> str:
    """The run's identity, kept in ``RUN_DIR/.run-id`` (a random hex string made by rank 0 on first
    use, written atomically): it survives moving or copying the run directory, and tells local
    copies of this run from those of another run that shares the node-local directory. A collective."""
    run_id = None
    if rank == 0:
        path = run_dir / ".run-id"
        if not path.exists():
            write_atomic(path, uuid.uuid4().hex)
        run_id = path.read_text().strip()
    return tgdist.broadcast_object(run_id)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
