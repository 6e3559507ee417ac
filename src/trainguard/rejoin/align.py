"""Alignment: a replacement's collectives line up with the survivors' before they run together.

A replacement runs the script from its top. After it has joined the survivors (the state
transferred, the new group formed) the script may still run a collective the survivors are not
waiting at: a ``dist.barrier()`` after ``first = next(guard.steps(n))``, an all-reduce of a dataset
size, a broadcast of a config. Such a collective pairs with whatever the survivors run next (DDP's
gradient all-reduce, say), the two never match, and only the backend's timeout ends them (gloo 30 s,
NCCL 10 min). This module finds it at once:

* The **lowest survivor** names the place of its first collective after the meeting (its *site*)
  in the recovery store (:meth:`~.protocol.RecoveryStore.reached`), once, when it reaches it, and
  runs it; the other survivors do nothing.
* A **replacement**, at each collective it reaches after the meeting, compares its own site with
  the survivors' (waiting for it at most ``wait`` seconds): the same site, and the window closes,
  the collective runs for real; another site of the script's own (:mod:`.catch`'s wrapped
  ``torch.distributed`` calls), and it completes on the replacement alone, as the collectives
  before its join do (a ``collective_alone`` event and one console line say which and why), and
  the next one is compared; another site that cannot run alone (DDP's backward, trainguard's own
  step collectives), no site from the survivors within ``wait``, or the end of its first step
  while the survivors wait at a collective it did not reach: the recovery fails
  (:class:`AlignmentError`, said in the recovery store and on the console). The rank then exits,
  and the launcher restarts the group by the progress rule (:mod:`trainguard.launcher.membership`):
  seconds, never the backend's timeout.
* The window ends with the first step after the meeting: a survivor that reached no collective in
  it names :data:`END`, the end of the step.

A *site* is the operation and the innermost frame that called it outside trainguard
(``dist.barrier at train.py:57 (main)``); the frames above it are not compared, since a survivor
that runs the interrupted step again inside a framework's step reaches the same call through other
frames. DDP's backward and trainguard's own collectives have fixed
names, and so has DDP's buffer broadcast at the start of its forward (a model with buffers, such as
batch norm's running statistics, and ``broadcast_buffers``). A place, not a count, identifies a
collective: a collective called from the same line on both sides is the same one.

Each Guard has one :class:`Alignment` (its collective catch's, :attr:`~.catch.Catch.align`); the
Guard opens the window after a meeting and closes it in ``close()``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import console
from .protocol import RecoveryStore

DDP_BACKWARD = "DDP's gradient all-reduce (backward)"
DDP_FORWARD = "DDP's buffer broadcast (forward)"
SHOULD_STEP = "trainguard's should_step"
STOP_CHECK = "trainguard's stop check"
END = "the end of the step (no collective in it)"
WAIT_FLOOR = 3.0  # seconds a replacement waits at least for the survivors' site
WAIT_STEPS = 3  # ... or this many of the survivors' step times, if longer

_LEFT_OUT = ("trainguard", "runpy", "importlib")  # packages whose frames are not part of a site


class AlignmentError(RuntimeError):
    """A replacement's collectives cannot line up with the survivors' (see the module's doc): the
    recovery failed, the launcher restarts the group."""


def wait_bound(step_seconds: float) -> float:
    """Seconds a replacement waits for the survivors' site: ``max(WAIT_FLOOR, WAIT_STEPS × step)``
    (the survivors reach their first collective within their first step after the meeting)."""
    return max(WAIT_FLOOR, WAIT_STEPS * step_seconds)


def script_site(op: str, frame: Any) -> str:
    """The site of the script's collective ``op`` called from ``frame``: the op and the innermost
    frame that is not trainguard's (file, line, function). Only that frame: a survivor may reach the
    same call through other frames (the Hugging Face Trainer's step run again by trainguard's
    callback after a lost peer was replaced)."""
    f = frame
    while f is not None and f.f_globals.get("__name__", "").partition(".")[0] in _LEFT_OUT:
        f = f.f_back
    if f is None:
        return op
    return f"{op} at {_absolute(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"


@functools.lru_cache(maxsize=256)
def _absolute(filename: str) -> str:
    """A code object's file name made absolute and free of links: the same file names the same
    site whether the script was started by a relative or an absolute path."""
    return os.path.realpath(filename)


@dataclass
class _Window:
    """The first step after a meeting (:class:`Alignment`)."""

    store: RecoveryStore
    number: int  # the generation
    after: int  # the step boundary of the meeting: the window ends with the step after it
    publisher: bool  # the lowest survivor (else a replacement)
    wait: float = WAIT_FLOOR
    rank: int = 0
    on_alone: Callable[[str, str], None] = lambda mine, theirs: None
    theirs: Optional[str] = None  # the survivors' site, once read
    alone: list[str] = field(default_factory=list)  # the sites this replacement ran alone


class Alignment:
    """The alignment of one process (see the module's doc): nothing while no window is open."""

    def __init__(self) -> None:
        self._window: Optional[_Window] = None
        self._first: Optional[tuple[RecoveryStore, int, int, int]] = None  # (store, generation, after, rank)

    @property
    def open(self) -> bool:
        """Whether a window is open (a collective is compared or named)."""
        return self._window is not None

    @property
    def active(self) -> bool:
        """Whether a window is open or the first step after a meeting is watched (:meth:`waiting`):
        the script's collectives are looked at (:meth:`at`, :meth:`waiting`), and
        :meth:`step_end` is due at the step's end."""
        return self._window is not None or self._first is not None

    def survivor(self, store: RecoveryStore, number: int, after: int, lowest: bool, rank: int = 0) -> None:
        """A survivor (rank ``rank``) met generation ``number`` at step boundary ``after``: the lowest
        survivor (``lowest``) names its first collective from now on; every survivor says which of
        the script's collectives it is in until its first step ends (:meth:`waiting`)."""
        self._window = _Window(store, number, after, publisher=True) if lowest else None
        self._first = (store, number, after, rank)

    def replacement(
        self,
        store: RecoveryStore,
        number: int,
        after: int,
        rank: int,
        wait: float,
        on_alone: Callable[[str, str], None],
    ) -> None:
        """A replacement (rank ``rank``) joined generation ``number`` at step boundary ``after``:
        compare its collectives with the survivors' from now on, waiting ``wait`` seconds at most
        for theirs (:func:`wait_bound`); ``on_alone(mine, theirs)`` is told each site run alone."""
        self._window = _Window(store, number, after, publisher=False, wait=wait, rank=rank, on_alone=on_alone)
        self._first = (store, number, after, rank)

    def close(self) -> None:
        """No window any more (the Guard's ``close()``, a new recovery)."""
        self._window = None
        self._first = None

    @contextlib.contextmanager
    def waiting(self, site: Optional[str]) -> Iterator[None]:
        """Around one of the script's collectives at ``site`` in the first step after a meeting:
        the recovery store says this rank is in it until it returns (two store writes), so that a
        rank that ended the step can tell a collective it never runs (the loop check,
        :mod:`.loop_check`). Nothing otherwise (``site`` ``None`` or no step watched)."""
        first = self._first
        if first is None or site is None:
            yield
            return
        store, number, _, rank = first
        store.waiting_at(number, rank, site)
        try:
            yield
        finally:
            try:
                store.waiting_at(number, rank, "")
            except Exception:  # noqa: BLE001 (the launcher's store gone: the collective's outcome says enough)
                pass

    def at(self, site: str, alone_ok: bool) -> bool:
        """A collective at ``site`` is about to run: ``True``: run it; ``False`` (only when
        ``alone_ok``): complete it on this rank alone. Nothing to do (``True``) without a window.

        Raises:
            AlignmentError: a replacement cannot line up with the survivors (said first).
        """
        w = self._window
        if w is None:
            return True
        if w.publisher:
            self._window = None
            w.store.reached(w.number, site)
            return True
        theirs = w.theirs if w.theirs is not None else w.store.survivors_site(w.number, w.wait)
        if theirs is None:
            self._fail(w, f"the survivors reached no collective within {w.wait:.1f} s of this rank's {site}")
        w.theirs = theirs
        if theirs == site:
            self._window = None
            return True
        if not alone_ok:
            self._fail(w, f"this rank reached {site} while the survivors wait at {theirs}")
        w.alone.append(site)
        w.on_alone(site, theirs)
        return False

    def step_end(self, step: int) -> None:
        """Completed step ``step`` ended (the Guard's ``step_end``): the window ends with the first
        step after the meeting; a survivor that named nothing names :data:`END`, a replacement
        still comparing must find the survivors there too.

        Raises:
            AlignmentError: the survivors wait at a collective this replacement did not reach in
                its first step.
        """
        if self._first is not None and step > self._first[2]:
            self._first = None
        w = self._window
        if w is None or step <= w.after:
            return
        self.at(END, alone_ok=False)

    def _fail(self, w: _Window, why: str) -> None:
        self._window = None
        if w.alone:
            why += f" (it ran {', '.join(w.alone)} alone before)"
        reason = f"rank {w.rank}'s collectives do not line up with the survivors': {why}"
        console.say(f"in-process recovery failed: {reason}")
        try:
            w.store.give_up(w.number, reason)
        except Exception as e:  # the store is the launcher's: it may be gone; the exit says enough
            print(f"trainguard: could not tell the launcher ({e})", file=sys.stderr)
        raise AlignmentError(reason)
