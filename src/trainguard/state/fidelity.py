"""Resume fidelity: what a bitwise-identical resume depends on that a checkpoint cannot restore.

A checkpoint restores the tensors, the data position and the random number generators. The result
of a resumed run is still only bitwise identical to an uninterrupted one when the arithmetic is
the same, and when no random numbers the checkpoint does not cover were drawn. Two checks, each
reported as a ``resume_not_bitwise`` event and one console line (rank 0), never an error:

* **The environment at save vs. at resume** (:class:`ResumeFidelity`, a part of every rank's
  saved state): torch's version, its intra-op thread count (``torch.get_num_threads()``: CPU
  reductions are split by thread, so their rounding depends on it; ``OMP_NUM_THREADS`` sets it),
  the deterministic-algorithm flags (``torch.use_deterministic_algorithms``, cuDNN's
  ``deterministic`` and ``benchmark``) and the world size.
* **Random numbers drawn between** ``step_end()`` **and the next step** (:class:`DrawWatch`): a
  loop that fetches the next batch after ``step_end()`` (``X, Y = get_batch()`` at the end of the
  body) draws it after the state the checkpoint holds, so a resumed run draws a different batch;
  so does an epoch loop at each new epoch (``for batch in loader``: a ``DataLoader`` iterator draws
  its base seed from torch's generator when it is created), and a resume inside that epoch creates
  its iterator again, one draw more than the uninterrupted run. In a ``steps()`` loop the Guard
  keeps the state of the generators a checkpoint restores (torch's CPU generator, NumPy's global
  one, Python's ``random``: a batch is drawn with ``torch.randint`` in nanoGPT-shaped loops, with
  ``np.random`` in others) at each ``step_end()`` and compares it when the next step begins (about
  15 µs a step), until it finds a draw (said once) or the run ends; a loop that never asks for the
  next step (a framework's callbacks) is watched for :data:`WATCHED_STEPS` steps.
* **Random numbers drawn between creating the Guard and** ``guard.steps()`` (:class:`DrawWatch`
  too): a loop that fetches its first batch before the loop and the next one inside the step
  (``X, Y = get_batch()`` before ``for step in guard.steps(...)``) draws that first batch, on a
  resume, from the fresh seed, before ``steps()`` restores the checkpoint's generators: the first
  resumed step trains on another batch. Reported on a resume only (a fresh run is not affected).
* **A batch fetched before the Guard exists and the next one inside the step, after the forward**
  (nanoGPT's ``train.py``: ``X, Y = get_batch()`` before its loop, ``X, Y = get_batch()`` right after
  ``model(X, Y)``; :meth:`DrawWatch.watch_first_step`): the first draw is older than anything the
  Guard sees, so it is found by its shape in the first step of a process that restored the
  generators (a resume, an in-process replacement): no draw between the loop's start and the first
  forward (the batch it trains on was in hand already), a draw after the step's last forward (the
  next batch). That first step trained on a batch from the fresh seed: reported at its end.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import torch

from ..ranks import RankView
from .datapos import DataWatch, known_objects
from .determinism import numpy_snapshot, rng_fingerprint

WATCHED_STEPS = 3  # boundaries DrawWatch looks at in a loop that never asks next_step (a framework's)

# why a draw between step_end() and the next step makes a resume not bitwise (DrawWatch.next_step)
DRAWN_BETWEEN_STEPS = (
    "random numbers were drawn between guard.step_end() and the next step (a batch fetched after step_end, or a "
    "new epoch's DataLoader iterator, which draws its seed from torch's generator): the checkpoint's generator "
    "state does not cover them, and a resume or a replacement that makes its iterator mid-epoch gives its worker "
    "processes other seeds (random transforms in the workers differ); draw them inside the step, and seed the "
    "loader's own generator from the epoch (DataLoader(..., generator=g), g.manual_seed(seed + epoch) before each "
    "epoch) or give the Guard a torchdata StatefulDataLoader (its state carries the workers' seed)"
)

# why a restored process whose first step trained on a batch fetched before the loop is not bitwise
DRAWN_AFTER_RESUME = (
    "random numbers were drawn between the resume (guard.begin()) and the first step (a DataLoader iterator made "
    "there draws its workers' seed from torch's generator): the run that saved the checkpoint drew none at that "
    "step; give the loader a generator of its own (DataLoader(..., generator=torch.Generator())) or make the "
    "iterator inside the step"
)
PREFETCHED = (
    "the first step's batch was fetched before the loop and the next one inside the step, after the forward "
    "(nanoGPT's order): this process drew that first batch from the fresh seed, not from the generators it "
    "resumed; fetch the first batch inside the loop (if x is None: x, y = get_batch()) or after guard.begin()"
)


def environment(world_size: int) -> dict[str, Any]:
    """The facts of this process that a bitwise resume depends on (plain values)."""
    cudnn = torch.backends.cudnn
    return {
        "torch": str(torch.__version__),  # a TorchVersion (a str subclass) would not load with weights_only
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "world_size": world_size,
    }


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``["threads 4 → 1", ...]``: the facts that differ (a fact missing on either side is skipped)."""
    return [f"{k} {saved[k]} → {now[k]}" for k in now if k in saved and saved[k] != now[k]]


class ResumeFidelity:
    """A Stateful part of the training state: saves :func:`environment`; on load, keeps what
    differs in :attr:`changed` (empty: the resume can be bitwise identical).

    Args:
        ranks: the shared view of the group (:class:`~trainguard.ranks.RankView`): its world size
            when a checkpoint is saved or loaded (a shrink in place changes it there).
    """

    def __init__(self, ranks: RankView):
        self.ranks = ranks
        self.changed: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return environment(self.ranks.world_size)

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        self.changed = differences(state or {}, environment(self.ranks.world_size))


def _generators() -> tuple[Any, ...]:
    """The state of the generators a checkpoint restores (:func:`~trainguard.state.determinism.capture_rng`):
    torch's CPU generator, NumPy's global one (any bit generator), Python's ``random``; the raw
    bytes of :func:`~trainguard.state.determinism.rng_fingerprint` where it is available (about
    10 µs), else each generator's public state (about 150 µs)."""
    fingerprint = rng_fingerprint()
    if fingerprint is not None:
        return fingerprint
    return torch.get_rng_state().numpy().tobytes(), numpy_snapshot(), random.getstate()


def _same(a: tuple, b: tuple) -> bool:
    """Whether two :func:`_generators` states are equal (no draw from any of them in between)."""
    return a == b


class DrawWatch:
    """Finds random numbers drawn (from torch's CPU generator, NumPy's global one or Python's
    ``random``) between ``step_end()`` and the next step: at every boundary of a loop that asks
    :meth:`next_step` (``steps()``), at the first :data:`WATCHED_STEPS` of one that does not.

    :meth:`boundary` at the end of ``step_end()``, :meth:`next_step` when the loop asks for the
    next step; :meth:`next_step` returns ``True`` once, at the first boundary where the state
    moved, and nothing is copied after that.
    """

    def __init__(self) -> None:
        self._left = WATCHED_STEPS  # boundaries left to watch while no one asked next_step
        self._asked = False  # next_step was called: the loop is a steps() loop, watched throughout
        self._found = False  # a draw was reported: no more looking
        self._state: Optional[tuple] = _generators()  # at the Guard's creation
        self._first: Optional[dict[str, Any]] = None  # watch_first_step's states
        self._drawn_before_loop = False  # before_loop found a draw (reported: the first step is not watched)
        self._hooks: list[Any] = []
        self._begun: Optional[tuple] = None  # the generators once a resume restored them (watch_begin)
        self.data = DataWatch()  # the first step's data loaders whose position is not saved (state.datapos)

    def watch_first_step(
        self, model: Any, restored: bool, report: Callable[[str], None], state: Optional[Any] = None, seeds: bool = True
    ) -> None:
        """At the loop's start (after a resume or a replacement's join restored the generators):
        watch this process's first step for nanoGPT's prefetch (see the module doc), by a forward
        pre-hook and a forward hook on ``model``, removed at the step's end, and for data loaders
        whose position the checkpoint (``state``, the rank's
        :class:`~trainguard.state.trainstate.TrainState`) does not hold (:mod:`.datapos`).
        ``seeds``: also say a loader's iterator made after the resume that drew its seed from torch's
        global generator (:data:`~.datapos.SEED_DRAWN`; off for a framework's loop).
        ``report(cause)`` is called at that end for each finding; nothing is watched where
        ``restored`` is false (a fresh run trains on the batch its fresh seed drew, as it should)."""
        if restored and state is not None:
            self.data.arm(model, known_objects(state), report, seeds)
        if not restored or self._drawn_before_loop or not hasattr(model, "register_forward_pre_hook"):
            return  # (a draw between the Guard and the loop was reported already: the same first batch)
        self._first = {"start": _generators(), "at_forward": None, "after_forward": None, "report": report}
        self._hooks = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def watch_begin(self) -> None:
        """A loop that calls ``guard.begin()`` itself resumed (or joined): keep the generators as the
        resume left them, to find draws made before its first step (:meth:`first_step_opens`)."""
        self._begun = _generators()

    def first_step_opens(self) -> bool:
        """The first step after :meth:`watch_begin` opens: whether random numbers were drawn since
        (the checkpoint's run drew none between that step boundary and the step). ``False`` once
        asked, or without :meth:`watch_begin`."""
        begun, self._begun = self._begun, None
        return begun is not None and not _same(begun, _generators())

    def _pre(self, module: Any, args: Any) -> None:
        if self._first is not None and self._first["at_forward"] is None:
            self._first["at_forward"] = _generators()

    def _post(self, module: Any, args: Any, out: Any) -> None:
        if self._first is not None:
            self._first["after_forward"] = _generators()

    def _end_first_step(self) -> None:
        first, self._first = self._first, None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if first is None or first["at_forward"] is None or first["after_forward"] is None:
            return
        if _same(first["start"], first["at_forward"]) and not _same(first["after_forward"], _generators()):
            first["report"](PREFETCHED)

    def before_loop(self) -> bool:
        """At ``steps()`` start, before a resume restores the generators: whether random numbers
        were drawn since the Guard was created."""
        moved = self._state is not None and not _same(self._state, _generators())
        self._state = None
        self._drawn_before_loop = moved
        return moved

    def boundary(self) -> None:
        """Keep the generators' state at this step boundary (about 10 µs: :func:`_generators`), in a
        loop that asks :meth:`next_step`, until a draw was found; else only at the first
        :data:`WATCHED_STEPS` boundaries, so a loop that never asks, as the framework callbacks do
        not, stops paying for it."""
        if self._first is not None:
            self._end_first_step()
        if self.data.armed:
            self.data.disarm()
        self._left -= 1
        watch = not self._found and (self._asked or self._left >= 0)
        self._state = _generators() if watch else None

    def next_step(self) -> bool:
        """Whether random numbers were drawn since :meth:`boundary` (reported once)."""
        self._asked = True
        if self._state is None:
            return False
        moved = not _same(self._state, _generators())
        self._state = None
        self._found = self._found or moved
        return moved
