"""Where training starts, and loading a checkpoint into the running process.

A component of :class:`~trainguard.guard.Guard`: it finds the newest valid checkpoint (either
tier), loads the whole training state from it (resharded when another number of ranks wrote it,
:mod:`trainguard.state.reshard`), and says when a resume cannot be bitwise identical
(:mod:`trainguard.state.fidelity`). It returns the step loaded; the Guard keeps the step counter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from .. import console
from ..checkpoint.checkpointer import Checkpointer, ResumePoint
from ..checkpoint.store import Checkpoint
from ..events import EventLog
from ..state.fidelity import DrawWatch, ResumeFidelity
from ..state.reshard import ElasticState, check_reshardable, resharded_rank_state
from ..state.trainstate import TrainState
from .world import World

# why a resume (or a replacement's join) that found random numbers drawn before steps() is not bitwise
DRAWN_BEFORE_LOOP = (
    "random numbers were drawn between creating the Guard and guard.steps() (a first batch fetched before the "
    "loop?): this process drew them from the fresh seed, not the checkpoint's or the lost rank's generators; "
    "draw batches inside the step"
)


@dataclass(frozen=True)
class Resumed:
    """A resume: ``step`` (completed steps loaded), ``checkpoint`` (the step and path it came
    from; a local-tier copy's path when it came from the node-local tier) and the persistent
    checkpoint it came from, if any (``persistent``: the instability recovery's known-good bookkeeping)."""

    step: int
    checkpoint: Checkpoint
    persistent: Optional[Checkpoint]


class Resume:
    """Loads training state for one rank.

    Args:
        ckpt: the checkpointer (both tiers).
        train_state: the Guard's named ``Stateful`` parts (loaded from the checkpoint's rank state).
        sampler: the data position (checked before a reshard), or ``None``.
        events: the event log.
        fidelity, draws: what makes a resume not bitwise (:mod:`trainguard.state.fidelity`).
        elastic: the world size the run started with (:class:`~trainguard.state.reshard.ElasticState`).
        keep: ``[elastic] keep`` (for the console line of a reshard).
        world: the shared view (this rank and the world size now: a shrink or growth renumbers it).
    """

    def __init__(
        self,
        ckpt: Checkpointer,
        train_state: TrainState,
        sampler: Any,
        events: EventLog,
        fidelity: ResumeFidelity,
        draws: DrawWatch,
        elastic: ElasticState,
        keep: str,
        world: World,
    ):
        self.ckpt, self.train_state, self.sampler, self.events = ckpt, train_state, sampler, events
        self.fidelity, self.draws, self.elastic, self.keep = fidelity, draws, elastic, keep
        self.world = world

    def resume(self) -> Optional[Resumed]:
        """At ``steps()`` start: load the newest valid checkpoint of either tier (a collective);
        ``None`` on a fresh start. Warns when the resume cannot be bitwise identical.

        Raises:
            BadInput: the checkpoint does not fit the model, or the sampler cannot reshard.
            ReadError: the checkpoint could not be read (after retries).
        """
        t0 = time.perf_counter()
        drawn = self.draws.before_loop()
        point = self.ckpt.find_resume()
        if point is None:
            return None
        step = self.load(point)
        path = self.ckpt.path_of(point)
        if self.world.rank == 0:
            seconds = round(time.perf_counter() - t0, 4)
            self.events.emit("resume", step, path=str(path), from_step=point.step, tier=point.tier, seconds=seconds)
            if point.tier == "jit":
                console.say(
                    f"resuming from the just-in-time copy of step {step} (saved from the survivors' memory "
                    "before the group restarted; newer than every checkpoint)"
                )
        if self.fidelity.changed:
            self.not_bitwise(step, f"changed since the checkpoint was saved: {', '.join(self.fidelity.changed)}")
        if drawn:
            self.not_bitwise(step, DRAWN_BEFORE_LOOP)
        buckets = self.train_state.parts.get("buckets")
        cause = buckets.impose() if buckets is not None else None  # DDP's rebuilt bucket layout (state.buckets)
        if cause is not None:
            self.not_bitwise(step, cause)
        return Resumed(step, Checkpoint(point.step, path), point.checkpoint)

    def load(self, point: ResumePoint) -> int:
        """Load the whole training state from ``point`` (a collective); written by another number
        of ranks, it is resharded (see :mod:`trainguard.state.reshard`). Returns the step loaded.

        Raises:
            BadInput: the checkpoint does not fit the model, or the sampler cannot reshard.
        """
        saved = self.ckpt.written_by(point)
        if saved != self.world.world_size:
            check_reshardable(self.sampler, point.checkpoint.path, saved, self.world.world_size)
            state = resharded_rank_state(self.ckpt.load(point, rank_state_of=0), self.world.rank)
        else:
            state = self.ckpt.load(point)
        step = int(state["step"])
        self.train_state.load_state_dict(state)
        self.ckpt.loaded(point.tier, step)
        if saved != self.world.world_size and self.world.rank == 0:
            self.events.emit(
                "world_size_changed",
                step,
                from_world_size=saved,
                to_world_size=self.world.world_size,
                base_world_size=self.elastic.base_world_size,
                keep=self.keep,
                path=str(point.checkpoint.path),
            )
            console.say(
                f"resuming on {self.world.world_size} rank(s) from a checkpoint of {saved}: data position carried "
                f"over, random number streams derived per rank, keep {self.keep.replace('_', ' ')}"
            )
        return step

    def reload(self, target: Checkpoint, why: str) -> int:
        """Load persistent checkpoint ``target`` into this process (a rollback; a collective) and
        set aside the local copies newer than it. Returns the step loaded."""
        step = self.load(ResumePoint("persistent", target.step, target))
        self.ckpt.discard_local_after(target.step, why)
        return step

    def not_bitwise(self, step: int, cause: str, say: bool = False) -> None:
        """Warn that a resume cannot be bitwise identical (see :mod:`trainguard.state.fidelity`): an event
        from this rank, one console line from rank 0 (``say``: from this rank, whichever it is: an
        in-process replacement, the only rank that resumed)."""
        self.events.emit("resume_not_bitwise", step, rank=self.world.rank, cause=cause)
        if self.world.rank == 0 or say:
            console.warn(f"a resume cannot be bitwise identical: {cause}")
