"""Fault injection, to test recovery and to rehearse it (``[faults]``, ``trainguard run --inject``).

Kinds (see :class:`~trainguard.config.FaultSpec`):

* ``rank_killed``: the rank SIGKILLs itself;
* ``rank_hung`` with ``hang = "sigstop"``: the rank SIGSTOPs itself (alive, silent);
* ``rank_hung`` with ``hang = "collective"``: the rank's main thread blocks before its next
  collective, so the other ranks wait inside it (the classic distributed hang);
* ``rank_hung`` with ``hang = "spin"``: the rank's main thread spins in place (busy, its stack
  unchanged: a loop that never ends);
* ``random``: one of the two above, at a rank and step drawn from ``seed`` (reproducible);
* numeric faults, applied to one rank's values in step number ``step`` (and the ``repeat - 1``
  after it): ``nan_loss`` (loss and gradients NaN), ``loss_spike`` (loss × ``factor``),
  ``grad_explosion`` (gradients and their norm × ``factor``). Each step fires once; ``persistent``
  makes it fire again when a rollback re-runs the step. Where they are applied: with a DDP model
  whose detectors ride in its gradient all-reduce (:mod:`trainguard.instability.fold`), at the
  ``backward()`` call, before the all-reduce, where real NaNs and spikes arise
  (:meth:`FaultInjector.at_backward`: the backward runs with ``gradient = factor``, so every rank
  gets the reduced gradients, as from a real fault on one rank); otherwise in
  ``guard.should_step()``, on this rank's values after the backward.
* ``sdc``: one bit flips in place (:func:`trainguard.sdc.replicas.flip_bit`), once (or each time the step
  is done again, with ``persistent``): with ``target = "param"`` in the rank's first parameter at
  the end of step ``step`` (after the optimizer step: a silent corruption of that replica); with
  ``"grad"`` in its first gradient in ``should_step()`` of step number ``step``; with
  ``"activation"`` in the model's output in the step's first forward (:func:`grow_bit`).
* ``slow_rank``: from step ``step`` for ``repeat`` steps, ``guard.run_step()`` on this rank
  sleeps ``factor`` × its compute time after the micro-batches (a straggler, for the detector).
* ``oom``: in ``guard.run_step()`` of step number ``step`` (and the ``repeat - 1`` after it), one
  rank asks the allocator for an impossible amount of memory inside the model's forward or
  during backward (``phase``), so the error is the allocator's own (``torch.OutOfMemoryError`` on
  CUDA, the CPU allocator's ``RuntimeError`` on CPU), not an imitation. Once per step, or in
  every retry of the step with ``persistent``.
* ``slow_io``: once ``step`` steps are complete, the rank's main thread stalls for ``seconds`` in
  I/O that makes progress (:func:`slow_io`: a stalled shared file system, a DataLoader respawn):
  silent past its timeout but moving bytes, so the hang supervisor calls it slow, not hung.

A fault fires when the rank has completed ``step`` steps (at the end of the step; with ``section``
``"checkpointing"`` inside the next checkpoint save, ``"should_step"`` in the next step's
``should_step`` before its all-reduce, ``"stop_check"`` in the stop check after the step, when one
is due then), or ``after_seconds`` after the
Guard started (then from a timer thread: ``collective`` is not possible and SIGSTOP is used).
By default it fires only in the first attempt (restart count 0); ``every_attempt`` makes it recur,
``attempt=N`` moves it to attempt ``N`` (a second fault after the group restarted).
Each firing first writes a ``fault_injected`` event, so reports can tell injected from real faults.
"""

from __future__ import annotations

import math
import os
import random
import signal
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from .config import ConfigError, FaultSpec, parse_key_values
from .events import EventLog
from .sdc.replicas import INT_VIEW, flip_bit


def parse_inject(text: str) -> FaultSpec:
    """Parse ``KIND[:key=value,...]`` (``rank_hung:rank=1,step=30,hang=collective``).

    Raises:
        ConfigError: unknown kind or key, or a bad value.
    """
    kind, _, rest = text.partition(":")
    fields: dict = {"kind": kind.strip(), **parse_key_values(rest, f"--inject {text!r}", "KIND:key=value,...")}
    try:
        return FaultSpec.model_validate(fields)
    except ValueError as e:
        raise ConfigError(f"--inject {text!r}: {e}") from None


def validate(specs: list[FaultSpec], world_size: Optional[int]) -> None:
    """Check injections against the job before anything starts.

    Raises:
        ConfigError: a non-random fault without ``rank`` or without ``step``/``after_seconds``, or
            a rank outside ``[0, world_size)``.
    """
    for i, s in enumerate(specs):
        where = f"faults.inject[{i}] ({s.kind})"
        if s.kind != "random" and s.rank is None:
            raise ConfigError(f"{where}: 'rank' is required")
        if s.kind != "random" and s.step is None and s.after_seconds is None:
            raise ConfigError(f"{where}: give 'step' or 'after_seconds'")
        if s.kind in STEP_BOUND and s.step is None:
            raise ConfigError(f"{where}: a {s.kind} fault needs 'step' (after_seconds is not possible)")
        if world_size is not None and s.rank is not None and s.rank >= world_size:
            raise ConfigError(
                f"{where}: rank {s.rank} does not exist (world size {world_size}, ranks 0..{world_size - 1})"
            )


def grow_bit(value: torch.Tensor) -> int:
    """The highest exponent bit of the floating-point scalar ``value`` that is 0: flipping it
    makes the largest increase of magnitude one bit flip can make (× 2^64 for a float32 loss of 4)."""
    size = 8 * value.element_size()
    mantissa = round(-math.log2(torch.finfo(value.dtype).eps))
    bits = int(value.reshape(1).view(INT_VIEW[value.element_size()])[0])
    return next((b for b in range(size - 2, mantissa - 1, -1) if not (bits >> b) & 1), size - 2)


NUMERIC = ("nan_loss", "loss_spike", "grad_explosion")
STEP_BOUND = NUMERIC + ("oom", "slow_rank", "sdc", "slow_io")
# more bytes than any machine has: the allocator refuses at once, with its own error
IMPOSSIBLE_BYTES = 1 << 62


SLOW_IO_CHUNK = 4096  # bytes written, fsynced and read back per round of slow_io
SLOW_IO_PAUSE = 0.05  # seconds between rounds: the thread mostly waits, it hardly computes


def slow_io(seconds: float) -> int:
    """Stall the calling thread for ``seconds`` in slow I/O that makes progress: rounds of
    :data:`SLOW_IO_CHUNK` bytes written to a temporary file (deleted after), fsynced and read back,
    :data:`SLOW_IO_PAUSE` seconds apart. Returns the bytes moved (written plus read)."""
    moved, block, end = 0, b"\0" * SLOW_IO_CHUNK, time.monotonic() + seconds
    with tempfile.TemporaryFile() as f:
        while time.monotonic() < end:
            moved += os.pwrite(f.fileno(), block, 0)
            os.fsync(f.fileno())
            moved += len(os.pread(f.fileno(), SLOW_IO_CHUNK, 0))
            time.sleep(SLOW_IO_PAUSE)
    return moved


def provoke_oom(device: torch.device | str = "cpu") -> None:
    """Ask ``device``'s allocator for :data:`IMPOSSIBLE_BYTES`: raises the allocator's real
    out-of-memory error (``torch.OutOfMemoryError`` on CUDA, ``RuntimeError`` from the CPU allocator)."""
    torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8, device=device)


class FaultInjector:
    """Fires this rank's injected faults.

    Args:
        specs: all injections of the run (each rank keeps its own).
        rank, world_size: this rank and the job size (random draws use them).
        attempt: the worker-group restart count (faults fire in attempt 0 unless ``every_attempt``
            or ``attempt``).
        events: where the ``fault_injected`` events go.
    """

    def __init__(self, specs: list[FaultSpec], rank: int, world_size: int, attempt: int, events: EventLog):
        self.rank, self.world_size, self.attempt, self.events = rank, world_size, attempt, events
        self.specs = [
            s for s in specs if (attempt == 0 or s.every_attempt if s.attempt is None else attempt == s.attempt)
        ]
        self.pending: list[FaultSpec] = []
        self.numeric_pending: list[FaultSpec] = []
        self.oom_pending: list[FaultSpec] = []
        self.slow_pending: list[FaultSpec] = []
        self.sdc_pending: list[FaultSpec] = []  # target param
        self.activation_pending: list[FaultSpec] = []  # sdc, target activation
        self._hook: Any = None  # the forward hook of activation faults
        self._fired: set[tuple[str, int, int]] = set()  # (kind, spec index, step) of step-bound faults already fired
        self._at_backward: Optional[int] = None  # the step whose numeric faults were applied at the backward
        self._step_loss_factor = 1.0  # the loss factor of that step so far (over its backward calls)

    def arm(self, max_steps: int) -> None:
        """Resolve random draws (they need ``max_steps``) and start the timers of time-based faults."""
        for s in self.specs:
            if s.kind == "random":
                rng = random.Random(s.seed)
                s = s.model_copy(
                    update={
                        "kind": rng.choice(["rank_killed", "rank_hung"]),
                        "rank": rng.randrange(self.world_size) if s.rank is None else s.rank,
                        "step": s.step if (s.step or s.after_seconds) else rng.randint(1, max(1, max_steps - 1)),
                    }
                )
            if s.rank != self.rank:
                continue
            if s.kind in NUMERIC:
                self.numeric_pending.append(s)
            elif s.kind == "oom":
                self.oom_pending.append(s)
            elif s.kind == "slow_rank":
                self.slow_pending.append(s)
            elif s.kind == "sdc" and s.target == "grad":
                self.numeric_pending.append(s)
            elif s.kind == "sdc" and s.target == "activation":
                self.activation_pending.append(s)
            elif s.kind == "sdc":
                self.sdc_pending.append(s)
            elif s.after_seconds is not None and s.step is None:
                threading.Thread(target=self._fire_later, args=(s,), daemon=True, name="trainguard-fault").start()
            else:
                self.pending.append(s)

    def at(self, step: int, section: str) -> None:
        """Called by the Guard at ``section`` (``"step"``, ``"checkpointing"``, ``"should_step"``,
        ``"stop_check"``) once ``step`` steps are complete."""
        for s in self.pending:
            if s.step == step and s.section == section:
                self.fire(s, step)

    def _due(self, step: int, kinds: Any) -> list[tuple[int, FaultSpec]]:
        """The numeric faults of ``kinds`` due in step number ``step`` that have not fired in it
        (marked fired now)."""
        due = []
        for i, s in enumerate(self.numeric_pending):
            if s.kind not in kinds or not (s.step <= step < s.step + s.repeat):
                continue
            if not s.persistent and ("numeric", i, step) in self._fired:
                continue
            self._fired.add(("numeric", i, step))
            due.append((i, s))
        return due

    def at_backward(self, step: int) -> tuple[float, float]:
        """Called when ``backward()`` starts in step number ``step`` with a DDP model whose
        detectors ride in its gradient all-reduce: ``(loss factor, gradient factor)`` of the
        ``nan_loss``, ``loss_spike`` and ``grad_explosion`` faults due now (``(1.0, 1.0)``: none;
        NaN for ``nan_loss``), their ``fault_injected`` events written. The loss factor is the
        step's so far: a later backward of the same step (gradient accumulation) reports it too.
        The caller runs the backward with ``gradient = gradient factor`` and carries the loss ×
        loss factor in DDP's bucket; :meth:`numeric` then multiplies the loss itself (in place)
        and leaves those faults out of the step."""
        if self._at_backward != step:
            self._at_backward, self._step_loss_factor = step, 1.0
        loss_f = grad_f = 1.0
        for _, s in self._due(step, NUMERIC):
            self.events.emit("fault_injected", step, fault=s.kind, rank=self.rank, factor=s.factor, injected=True)
            if s.kind == "nan_loss":
                loss_f = grad_f = math.nan
            elif s.kind == "loss_spike":
                loss_f *= s.factor
            else:
                grad_f *= s.factor
        self._step_loss_factor *= loss_f
        return self._step_loss_factor, grad_f

    def due_at(self, step: int, section: str) -> bool:
        """Whether a fault fires at ``section`` once ``step`` steps are complete (see :meth:`at`)."""
        return any(s.step == step and s.section == section for s in self.pending)

    def numeric(self, step: int, loss: Any, grad_norm: Any, model: torch.nn.Module) -> tuple[Any, Any]:
        """Called by ``should_step()`` in step number ``step``: corrupt this rank's loss, gradients
        and gradient norm as the numeric faults due now say (of those :meth:`at_backward` applied
        in this step, only the loss is left: multiplied in place, so that it stays the tensor the
        backward ran on); returns the (loss, grad_norm) to check."""
        applied, self._at_backward = self._at_backward, None
        if applied == step and self._step_loss_factor != 1.0:  # the loss as the backward's faults made it
            if torch.is_tensor(loss):
                with torch.no_grad():
                    loss.mul_(self._step_loss_factor)  # in place: still the tensor backward() ran on
            else:
                loss = loss * self._step_loss_factor
        kinds = {"sdc"} if applied == step else {"sdc", *NUMERIC}
        for _, s in self._due(step, kinds):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if s.kind == "sdc":  # target grad: a flipped bit, no other sign of it
                self.events.emit("fault_injected", step, fault="sdc", rank=self.rank, target="grad", injected=True)
                flip_bit(grads[0])
                continue
            self.events.emit("fault_injected", step, fault=s.kind, rank=self.rank, factor=s.factor, injected=True)
            if s.kind == "nan_loss":
                loss = loss * float("nan")
                for gr in grads:
                    gr.fill_(float("nan"))
                grad_norm = None if grad_norm is None else grad_norm * float("nan")
            elif s.kind == "loss_spike":
                loss = loss * s.factor
            else:
                for gr in grads:
                    gr.mul_(s.factor)
                grad_norm = None if grad_norm is None else grad_norm * s.factor
        return loss, grad_norm

    def oom_due(self, step: int) -> Optional[FaultSpec]:
        """Called by ``run_step()`` before each attempt of step number ``step``: the ``oom`` fault
        to inject in this attempt (its ``fault_injected`` event written), or ``None``."""
        for i, s in enumerate(self.oom_pending):
            if not (s.step <= step < s.step + s.repeat) or (not s.persistent and ("oom", i, step) in self._fired):
                continue
            self._fired.add(("oom", i, step))
            self.events.emit("fault_injected", step, fault="oom", rank=self.rank, phase=s.phase, injected=True)
            return s
        return None

    def corrupt(self, step: int, model: torch.nn.Module) -> None:
        """Called by ``step_end()`` once ``step`` steps are complete: an ``sdc`` fault due now flips
        one bit of the first parameter of ``model`` (its ``fault_injected`` event first); once, or
        each time the step is re-run after a rollback with ``persistent`` (a bad GPU)."""
        for i, s in enumerate(self.sdc_pending):
            if s.step != step or (not s.persistent and ("sdc", i, step) in self._fired):
                continue
            self._fired.add(("sdc", i, step))
            self.events.emit("fault_injected", step, fault="sdc", rank=self.rank, target="param", injected=True)
            flip_bit(next(model.parameters()))

    def watch_activations(self, model: torch.nn.Module, current_step: Callable[[], int]) -> None:
        """Install the forward hook of ``activation`` faults on ``model`` (on the module inside DDP:
        what a device computes). It flips one bit of the model's output (see :func:`grow_bit`) in
        the first forward of step number ``current_step()`` that a fault names, once; with
        ``persistent`` in every forward of that step on this rank (a bad device computes wrong
        every time, a re-run and a cross-check included). Nothing without such faults."""
        if not self.activation_pending:
            return

        def flip(module: torch.nn.Module, args: Any, output: Any) -> None:
            step = current_step()
            for i, s in enumerate(self.activation_pending):
                key = ("activation", i, step)
                fire = s.step == step and (s.persistent or key not in self._fired)
                if not fire or not torch.is_tensor(output) or not output.is_floating_point():
                    continue
                self._fired.add(key)
                self.events.emit(
                    "fault_injected", step, fault="sdc", rank=self.rank, target="activation", injected=True
                )
                flip_bit(output, 0, grow_bit(output.detach().reshape(-1)[0]))

        inner = model.module if isinstance(model, DistributedDataParallel) else model
        self._hook = inner.register_forward_hook(flip)

    def close(self) -> None:
        """Remove the forward hook of activation faults."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def slow_factor(self, step: int) -> float:
        """Called by ``run_step()`` in step number ``step``: the extra compute fraction of a
        ``slow_rank`` fault active now (0.0 if none); the first step of each writes its event."""
        for i, s in enumerate(self.slow_pending):
            if s.step <= step < s.step + s.repeat:
                if ("slow", i, 0) not in self._fired:
                    self._fired.add(("slow", i, 0))
                    self.events.emit(
                        "fault_injected",
                        step,
                        fault="slow_rank",
                        rank=self.rank,
                        factor=s.factor,
                        steps=s.repeat,
                        injected=True,
                    )
                return s.factor
        return 0.0

    def _fire_later(self, spec: FaultSpec) -> None:
        time.sleep(spec.after_seconds or 0)
        self.fire(spec.model_copy(update={"hang": "sigstop"}), None)

    def fire(self, spec: FaultSpec, step: Optional[int]) -> None:
        """Record the event, then inject the fault (does not return for a kill or a hang; returns
        after a ``slow_io`` stall's ``seconds``)."""
        self.events.emit(
            "fault_injected",
            step,
            fault=spec.kind,
            rank=self.rank,
            hang=spec.hang if spec.kind == "rank_hung" else None,
            seconds=spec.seconds if spec.kind == "slow_io" else None,
            section=spec.section,
            after_seconds=spec.after_seconds,
            injected=True,
        )
        if spec.kind == "rank_killed":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "slow_io":
            slow_io(spec.seconds)
        elif spec.hang == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.hang == "spin":
            while True:  # busy in place: the main thread computes and its stack never changes
                pass
        else:
            while True:  # block before the next collective: the peers wait inside it
                time.sleep(3600)
