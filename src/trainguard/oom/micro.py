"""Out-of-memory recovery: run a step over micro-batches; on OOM, halve them and retry the same batch.

::

    def step_fn(micro_batch):                    # forward only: return the micro-batch's mean loss
        x, y = micro_batch
        return F.cross_entropy(model(x), y)

    loss = guard.run_step(step_fn, (x, y))       # forward + backward over micro-batches

``run_step`` cuts the batch along its first dimension into micro-batches of the current size and,
for each, calls ``step_fn`` and runs backward on ``loss × (micro-batch samples / batch samples)``:
the accumulated gradients and the returned loss are those of the whole batch, whatever the split
(for a loss that is a mean over samples). An out-of-memory error, recognized by type
(``torch.OutOfMemoryError`` on CUDA, ``MemoryError``) or — for the CPU allocator, which raises a
plain ``RuntimeError`` — by the allocator's own message, is caught on the rank where it happens;
then every rank learns of it at the same point, drops the step's gradients and the failed attempt's
tensors, empties the allocator cache, halves the micro-batch and retries the same batch.

No rank is left waiting in a collective while a peer is out of memory: with a
``DistributedDataParallel`` model every micro-batch runs under ``no_sync()`` and
:class:`~trainguard.oom.sync.GradSync` averages the gradients instead of DDP's reducer —
overlapped with the last backward like DDP, but a failing rank can complete the same sequence of
all-reduces, and the per-rank out-of-memory codes ride in the last bucket, so a clean step costs
no extra collective. Other models in a
multi-rank job (FSDP2, hand-written all-reduce) get one small all-reduce of the flags after the
micro-batches; an out-of-memory error *inside* such a model's own collective leaves its peers in
that collective, and the hang supervisor restarts the group.

After ``[oom] grow_after`` clean steps the micro-batch doubles again (up to the batch); a grow
that runs out of memory before the next ``grow_after`` clean steps doubles that wait. At
micro-batch size 1 nothing is left to split: :class:`~trainguard.outcomes.GiveUp` (exit 76). The
micro-batch size and the counters are part of every checkpoint, so a resumed run splits alike
(needed for a bitwise-identical resume: the accumulation order changes floating-point sums).

Events: ``oom`` (each rank that ran out: phase, micro-batch size, error text, memory in use),
``micro_batch_split``, ``micro_batch_grow``, ``oom_give_up``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from typing import Any, Callable, Optional

import psutil
import torch
from torch.nn.parallel import DistributedDataParallel

from .. import dist as tgdist
from ..events import EventLog
from ..faults import FaultInjector, provoke_oom
from ..health.straggler import StragglerDetector
from ..instability import fold as fold_notes
from ..instability.fold import LossFold
from ..outcomes import BadInput, GiveUp
from ..ranks import RankView
from ..rejoin.align import DDP_BACKWARD, Alignment
from ..sections import OOMSection
from .sync import GradSync

# The CPU allocator raises a plain RuntimeError (c10::Error) whose text carries this; no type exists.
CPU_OOM_TEXT = "DefaultCPUAllocator: can't allocate memory"
PHASES = ("ok", "forward", "backward")  # per-rank codes exchanged between ranks


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory error: ``torch.OutOfMemoryError`` (CUDA, and other accelerators
    that raise it), Python's ``MemoryError``, or the CPU allocator's ``RuntimeError`` (recognized by
    :data:`CPU_OOM_TEXT`, since the CPU allocator has no exception type of its own)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and CPU_OOM_TEXT in str(exc)


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its tensors (a tensor, or tuples, lists and dicts of them).

    Raises:
        ValueError: no tensor in the batch, a 0-dim tensor, or tensors with different first dimensions.
    """
    sizes = {t.shape[0] if t.dim() else None for t in _tensors(batch)}
    if not sizes or None in sizes:
        raise ValueError(
            "run_step needs a batch of tensors with a first (sample) dimension, "
            f"got {type(batch).__name__}{' with a 0-dim tensor' if None in sizes else ''}"
        )
    if len(sizes) > 1:
        raise ValueError(
            f"the batch's tensors have different first dimensions {sorted(sizes)}; "
            "run_step splits every tensor along its first dimension"
        )
    return sizes.pop()


def _tensors(batch: Any) -> list[torch.Tensor]:
    if torch.is_tensor(batch):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _tensors(v)]
    return []


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` of every tensor in ``batch`` (views, no copy); other leaves unchanged."""
    if torch.is_tensor(batch):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return batch


class MicroBatcher:
    """Runs :meth:`Guard.run_step <trainguard.guard.Guard.run_step>` (one per Guard, every rank).

    Args:
        cfg: the ``[oom]`` section.
        model: the (possibly DDP-wrapped) model.
        events: the rank's event log.
        faults: injected ``oom`` / ``slow_rank`` faults.
        straggler: times the compute of each step.
        world: this rank and the group size, read at each use (:class:`~trainguard.ranks.RankView`:
            the Guard's shared world, which a shrink changes; :meth:`group_resized` then).
        fold: the detectors' values carried in the last gradient bucket (:mod:`trainguard.instability.fold`).
        before_last_bucket: called with the step just before that bucket is sent, when ``fold``
            rides in it (in-process recovery keeps the step boundary there: a peer may complete
            the step once it is sent).
        align: the Guard's alignment of a replacement's collectives with the survivors' after a
            meeting (:mod:`trainguard.rejoin.align`): the step's gradient all-reduce, which
            ``run_step`` issues itself (not DDP's hook), is named there as DDP's backward, so a
            replacement waiting at a collective of its script learns at once where the survivors
            are (before, they named nothing: it waited 3 s and the recovery failed, issue 55).

    Attributes:
        size: samples per micro-batch (``None`` until the first batch: the whole batch, or
            ``[oom] micro_batch_size``).
        clean: clean steps since the last split or grow.
        wait: clean steps before the next grow (``grow_after``, doubled by each failed grow).
    """

    def __init__(
        self,
        cfg: OOMSection,
        model: torch.nn.Module,
        events: EventLog,
        faults: FaultInjector,
        straggler: StragglerDetector,
        world: RankView,
        fold: Optional[LossFold] = None,
        before_last_bucket: Optional[Callable[[int], None]] = None,
        align: Optional[Alignment] = None,
    ):
        self.cfg, self.model, self.events, self.faults, self.straggler = cfg, model, events, faults, straggler
        self.world, self.fold, self.align = world, fold, align
        self.before_last_bucket = before_last_bucket
        self._step = 0  # the step run() is in (the fold's values are that step's)
        self.ddp = isinstance(model, DistributedDataParallel)
        self.sync: Optional[GradSync] = None  # created by the first run_step (its buffers take the gradients' size)
        self.size: Optional[int] = self.cfg.micro_batch_size or None
        self.clean = 0
        self.wait = self.cfg.grow_after
        self.grown = False  # the last size change was a grow that has not yet held for `wait` steps
        self._phase = "forward"

    # ------------------------------------------------------------------------------------------
    # the step

    def group_resized(self) -> None:
        """The group changed size in place (``world`` holds the new rank and size): the gradient
        buckets, which hold a slot per rank, are built again by the next step."""
        if self.sync is not None:  # its buckets hold a slot per rank: built again for the new size
            self.sync.close()
            self.sync = None

    def run(
        self,
        step: int,
        step_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        backward: Optional[Callable[[torch.Tensor], None]] = None,
    ) -> torch.Tensor:
        """Forward and backward of step number ``step`` over micro-batches, retried on OOM.

        Returns:
            The batch's loss (0-dim, detached): the sum of the micro-batch losses weighted by their
            share of the batch.
        Raises:
            BadInput: a batch that cannot be split, or a micro-batch size larger than the batch.
            GiveUp: micro-batch size 1 ran out of memory.
        """
        backward = backward or torch.Tensor.backward
        try:
            n = batch_size(batch)
        except ValueError as e:
            raise BadInput(str(e)) from None
        if self.cfg.micro_batch_size > n:
            raise BadInput(
                f"oom.micro_batch_size={self.cfg.micro_batch_size} is larger than the batch ({n} samples "
                f"on rank {self.world.rank}); expected 1..{n}, or 0 for the whole batch"
            )
        if self.size is None:
            self.size = n
        self._step = step
        if self.sync is None and self.ddp and self.world.world_size > 1:
            fold = self.fold if self.fold is not None and self.fold.wired else None
            self.sync = GradSync(
                list(self.model.parameters()),
                self.world.rank,
                self.world.world_size,
                int(self.cfg.bucket_mb * 2**20),
                (fold.size, self._last_bucket) if fold is not None else None,
            )
        self._maybe_grow(step, n)
        if self.sync is not None and self.align is not None and self.align.open:
            self.align.at(DDP_BACKWARD, alone_ok=False)  # after a meeting: the step's first collective
        while True:
            size = min(self.size, n)
            total, failure = self._attempt(step, step_fn, batch, n, size, backward)
            codes = self._agree(failure is not None)
            if not any(codes):
                break
            self._split(step, codes, n, size, self._free())
        if self.sync is not None and self.sync.extra_values is not None and self.fold is not None:
            self.fold.reduced(step, self.sync.extra_values)  # the detectors' and stop check's values
        self.clean += 1
        if self.grown and self.clean >= self.wait:
            self.grown = False  # the grow held
        return total

    def _attempt(
        self, step: int, step_fn: Callable, batch: Any, n: int, size: int, backward: Callable
    ) -> tuple[Optional[torch.Tensor], Optional[str]]:
        """One try at the whole batch; returns (loss, None) or (None, phase) after an OOM on this rank."""
        fault = self.faults.oom_due(step) if self.faults.oom_pending else None
        handle = self._arm(fault.phase) if fault is not None else None
        if self.ddp:  # the first forward syncs buffers as DDP's own would (no_sync forwards turn it off)
            self.model.require_forward_param_sync = True
        if self.sync is not None:
            self.sync.begin()
        timer = self.straggler.compute_timer(_device(self.model))
        try:
            timer.start()
            total = self._micro_batches(step_fn, batch, n, size, backward)
            slow = self.faults.slow_factor(step) if self.faults.slow_pending else 0.0
            if slow:
                time.sleep(slow * (time.perf_counter() - timer.t0))
            self.straggler.record_compute(timer.stop())
            return total, None
        except Exception as e:
            if not is_oom(e):
                raise
            self.events.emit(
                "oom",
                step,
                rank=self.world.rank,
                phase=self._phase,
                micro_batch=size,
                injected=fault is not None,
                error=str(e).splitlines()[0][:500],
                **memory_in_use(),
            )
            return None, self._phase  # leaving this block frees the traceback and the attempt's tensors
        finally:
            if handle is not None:
                handle.remove()

    def _micro_batches(self, step_fn: Callable, batch: Any, n: int, size: int, backward: Callable) -> torch.Tensor:
        total = None
        divide = self.world.world_size if self.sync is not None else 1  # GradSync sums: pre-divide for the mean
        with self.model.no_sync() if self.ddp else contextlib.nullcontext():
            for start in range(0, n, size):
                stop = min(n, start + size)
                self._phase = "forward"
                loss = step_fn(slice_batch(batch, start, stop)) * ((stop - start) / n)
                self._phase = "backward"
                total = loss.detach() if total is None else total + loss.detach()
                if stop == n:
                    if self.sync is not None:
                        self.sync.arm()
                    fold_notes.pin(total)  # the loss run() returns rides in the last bucket (instability.fold)
                try:
                    backward(loss / divide if divide > 1 else loss)
                finally:
                    fold_notes.pin(None)
        return total

    def _arm(self, phase: str) -> Any:
        """Injected OOM: a real allocation failure inside the model's forward or during backward."""
        if phase == "forward":
            inner = getattr(self.model, "module", self.model)
            return inner.register_forward_pre_hook(lambda module, args: provoke_oom(_device(self.model)))
        last = [p for p in self.model.parameters() if p.requires_grad][-1]
        return last.register_post_accumulate_grad_hook(lambda p: provoke_oom(p.device))

    # ------------------------------------------------------------------------------------------
    # agreement, split, grow

    def _agree(self, failed: bool) -> list[int]:
        """Per-rank codes (index into :data:`PHASES`), the same list on every rank."""
        codes = [0] * self.world.world_size
        if failed:
            codes[self.world.rank] = PHASES.index(self._phase)
        if self.world.world_size == 1:
            return codes
        if self.sync is None:
            return tgdist.all_reduce_max(codes)
        return self.sync.finish(codes[self.world.rank])

    def _free(self) -> float:
        """Drop the step's gradients, collect garbage (a full collection: ~0.14 s in a process with
        torch imported, measured here), empty the CUDA allocator cache; returns the seconds it took."""
        t0 = time.perf_counter()
        for p in self.model.parameters():
            p.grad = None
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def _split(self, step: int, codes: list[int], n: int, size: int, cleanup_seconds: float) -> None:
        ranks = {r: PHASES[c] for r, c in enumerate(codes) if c}
        if size <= 1:
            self._give_up(step, ranks)
        new = (size + 1) // 2
        backoff = self.grown
        if backoff:
            self.wait *= 2
        self.size, self.clean, self.grown = new, 0, False
        self._emit(
            step,
            "micro_batch_split",
            from_size=size,
            to_size=new,
            batch=n,
            accumulation=[math.ceil(n / size), math.ceil(n / new)],
            ranks=ranks,
            grow_after=self.wait,
            backoff=backoff,
            cleanup_seconds=round(cleanup_seconds, 4),
        )

    def _last_bucket(self, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """The fold's values for the last bucket of the step in progress, after ``before_last_bucket``."""
        if self.before_last_bucket is not None:
            self.before_last_bucket(self._step)
        return self.fold.extra(self._step, buffer)  # type: ignore[union-attr]

    def _maybe_grow(self, step: int, n: int) -> None:
        if not self.cfg.grow or self.size >= n or self.clean < self.wait:
            return
        old, self.size = self.size, min(n, self.size * 2)
        self.clean, self.grown = 0, True
        self._emit(
            step,
            "micro_batch_grow",
            from_size=old,
            to_size=self.size,
            batch=n,
            accumulation=[math.ceil(n / old), math.ceil(n / self.size)],
        )

    def _give_up(self, step: int, ranks: dict[int, str]) -> None:
        where = ", ".join(f"rank {r} in {phase}" for r, phase in ranks.items())
        why = (
            f"out of memory at micro-batch size 1 in step {step} ({where}): the batch cannot be split further; "
            "reduce the model, the sequence length or the per-rank batch, or use more ranks"
        )
        self._emit(step, "oom_give_up", ranks=ranks, reason=why)
        raise GiveUp("out_of_memory", why)

    def _emit(self, step: int, kind: str, **details: Any) -> None:
        if self.world.rank == 0:
            self.events.emit(kind, step, **details)

    def close(self) -> None:
        """Remove the gradient hooks of the DDP gradient sync (safe to call twice)."""
        if self.sync is not None:
            self.sync.close()

    # ------------------------------------------------------------------------------------------
    # checkpointed state

    def state_dict(self) -> dict[str, Any]:
        """Micro-batch size and grow counters (saved in every checkpoint)."""
        return {"size": self.size, "clean": self.clean, "wait": self.wait, "grown": self.grown}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore :meth:`state_dict` (``None``: a checkpoint from before this state existed)."""
        if state:
            self.size, self.clean, self.wait, self.grown = state["size"], state["clean"], state["wait"], state["grown"]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def memory_in_use() -> dict[str, Any]:
    """This process's resident set size and, on CUDA, the allocator's allocated/reserved bytes."""
    out: dict[str, Any] = {"rss_bytes": psutil.Process().memory_info().rss}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update(cuda_allocated_bytes=torch.cuda.memory_allocated(), cuda_reserved_bytes=torch.cuda.memory_reserved())
    return out
