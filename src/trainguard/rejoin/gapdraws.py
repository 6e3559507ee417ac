"""Random numbers drawn before a step's first forward, when the step is done again or a
replacement starts.

In-process recovery puts a rank's random number generators back to its step boundary: their
state at the previous ``step_end``. Between that ``step_end`` and the step's first forward a loop
may draw, and whether those draws happen again depends on the loop, not on trainguard. The
PyTorch ImageNet example's ``for ... in enumerate(train_loader)`` makes a new ``DataLoader``
iterator at each epoch's first step, and the iterator draws its base seed from torch's generator:

* **a survivor's step done again**: its loop does not make the epoch's iterator again (the
  batch comes back from the same one, :mod:`.replay`), so the interrupted attempt drew and the
  redo does not. At the redo's first forward the generators are then set to where the
  interrupted attempt's first forward found them. A loop that draws again (a batch drawn with
  ``torch.randint`` in the step) is left as it is: the same draws from the same state.
* **a replacement**: it takes the lost rank's boundary at its join, then runs the script's set-up
  for the step it starts at (the ImageNet loop makes the epoch's iterator at any step it resumes
  at: one draw; it runs no evaluation of the epoch before, whose iterator drew too). The
  survivors send it their interrupted attempt (:meth:`GapDraws.attempt`): their generators'
  fingerprints at the boundary and at the attempt's first forward, and their state there. At its
  first forward, generator by generator (Python's ``random``, NumPy's, torch's CPU one, CUDA's):

  - the lost rank's generator was at the survivors' state at the boundary (seeded alike on every
    rank: torch's in the ImageNet example, the HF Trainer, Lightning): the lost rank would have
    drawn as they did; it takes their state at that forward;
  - else (a seed per rank: nanoGPT, timm): drawn since the join but not in the attempt → back to
    the boundary it took; not since the join but in the attempt → the lost rank's draws cannot
    be made again, and it says the resume is not bitwise (``resume_not_bitwise``); drawn in
    both: left as it is (the same draws, it is assumed).

Cost: one generator fingerprint at each step's first forward (about 10 µs; a capture only when a
generator moved). Where the fingerprint is unavailable (a NumPy bit generator other than MT19937)
nothing is done.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..state.determinism import alike_across_ranks, fingerprint_by_generator

NOT_REPEATED = (
    "the interrupted step's attempt drew random numbers before its first forward (a new epoch's DataLoader "
    "iterator draws its seed from torch's generator), and its replacement drew none there: the lost rank's draws "
    "cannot be made again"
)


class GapDraws:
    """The generators' state at the first forward of the step in progress, and where a step done
    again or a replacement's first step takes it from (see the module's doc). A part of
    :class:`~.stepstart.StepStart` (``new_step`` at each step start, ``restore`` at a redo).

    Args:
        model: the model whose forward the step calls (a forward pre-hook is registered on it).
        rng: the rank's generators (:class:`~trainguard.state.trainstate.RNGState`).
        say: ``(cause) -> None``: a replacement's resume cannot be bitwise (the Guard writes
            ``resume_not_bitwise`` and a console line).
    """

    def __init__(self, model: torch.nn.Module, rng: Any, say: Callable[[str], None]):
        self.rng, self.say = rng, say
        self._fresh = False  # the next forward is the step's first
        self._at_forward: Optional[tuple[Any, Any]] = None  # (fingerprint, state) at it
        self._boundary: Any = None  # a redo: the fingerprint its boundary restored
        self._interrupted: Optional[tuple[Any, Any]] = None  # a redo: the interrupted attempt's first forward
        self._joined: Optional[tuple[Any, Any, Optional[dict]]] = None  # a replacement: boundary taken, attempt
        active = rng.snapshot()[0] is not None and hasattr(model, "register_forward_pre_hook")
        self._handle = model.register_forward_pre_hook(self._before_forward) if active else None

    def new_step(self) -> None:
        """A step starts (``StepStart.begin``): the previous step's first forward is forgotten (a
        step lost before its own first forward has none to give a redo)."""
        self._fresh = True
        self._at_forward = None

    def restore(self) -> None:
        """The step in progress is done again; its boundary's state was just restored."""
        if self._handle is not None and self._at_forward is not None:
            self._interrupted, self._boundary = self._at_forward, self.rng.snapshot()[0]
        self._fresh = True

    def rolled_forward(self, boundary_rng: dict[str, Any]) -> None:
        """A survivor that rolls the step in progress forward (nothing restored, nothing done
        again; :mod:`.forward`): that step is its attempt for a replacement's :meth:`joined`, from
        the step boundary whose generators' state was ``boundary_rng``. Call :meth:`forget` once
        the state was sent. (The generators are set to ``boundary_rng`` for its fingerprint and
        put back as they were.)"""
        if self._handle is None or self._at_forward is None:
            return
        now = self.rng.snapshot()[1]
        self.rng.load_state_dict(boundary_rng)
        self._boundary = self.rng.snapshot()[0]
        self.rng.load_state_dict(now)
        self._interrupted = self._at_forward

    def forget(self) -> None:
        """The recovery did not do the step again (a peer had completed it)."""
        self._interrupted = self._boundary = None

    def attempt(self) -> Optional[dict[str, Any]]:
        """A survivor at a recovery (after :meth:`restore`): its interrupted attempt, for a
        replacement's :meth:`joined`: ``{"boundary": the generators' fingerprint at the step
        boundary, "forward": at the attempt's first forward, "state": their state there}``;
        ``None`` when the attempt reached no forward."""
        if self._interrupted is None:
            return None
        fingerprint, state = self._interrupted
        return {"boundary": self._boundary, "forward": fingerprint, "state": state}

    def joined(self, attempt: Optional[dict[str, Any]]) -> None:
        """A replacement took the lost rank's boundary (its generators are at it now);
        ``attempt``: the survivors' :meth:`attempt`."""
        if self._handle is not None:
            fingerprint, state = self.rng.snapshot()
            self._joined = (fingerprint, state, attempt)

    def close(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._fresh:
            return
        self._fresh = False
        now = self.rng.snapshot()
        if self._joined is not None:
            now = self._first_after_join(now)
        elif self._boundary is not None:
            now = self._redo(now)
        self._at_forward = now

    def _redo(self, now: tuple[Any, Any]) -> tuple[Any, Any]:
        interrupted, boundary = self._interrupted, self._boundary
        self._interrupted = self._boundary = None
        if interrupted is not None and now[0] == boundary and interrupted[0] != boundary:
            self.rng.load_state_dict(interrupted[1])  # its draws are not made again: take their result
            return interrupted
        return now

    def _first_after_join(self, now: tuple[Any, Any]) -> tuple[Any, Any]:
        fingerprint, state, attempt = self._joined
        self._joined = None
        if attempt is None:
            return now
        joined, current = fingerprint_by_generator(fingerprint), fingerprint_by_generator(now[0])
        boundary, forward = fingerprint_by_generator(attempt["boundary"]), fingerprint_by_generator(attempt["forward"])
        take, lost = dict(now[1]), []
        for name in joined:
            if boundary.get(name) == joined[name] and alike_across_ranks(name):  # seeded alike: their draws were its
                take[name] = attempt["state"][name]
                continue
            moved, drew = current.get(name) != joined[name], forward.get(name) != boundary.get(name)
            if moved and not drew:
                take[name] = state[name]  # its set-up's draws were not the lost rank's
            elif drew and not moved:
                lost.append(name)
        if lost:
            self.say(f"{NOT_REPEATED} ({', '.join(lost)})")
        if any(take[name] is not now[1].get(name) for name in take):
            self.rng.load_state_dict(take)
            return self.rng.snapshot()
        return now
