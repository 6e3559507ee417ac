"""A step done again gets back the batches its interrupted attempt took from the loop's data loaders.

In-process recovery does a step again when a peer was lost before the step's update (the
survivors' state goes back to the step's start, :mod:`.stepstart`). A loop that iterates a
``DataLoader`` of its own (``for i, (images, target) in enumerate(train_loader)``, the PyTorch
ImageNet example; ``input, target = next(loader)``) would take the *next* batch for it: its
iterator moved on over the interrupted attempt, and the step done again trained on other data
(:mod:`.redo_check` then fails the recovery into a group restart).

:class:`BatchReplay` wraps the ``__next__`` of every ``DataLoader`` iterator (one class,
``_BaseDataLoaderIter``, serves the single-process and the worker-process loaders; listed in
:mod:`trainguard.compat`) while the Guard lives. It keeps a reference to each batch an iterator
yields between two ``guard.step_end`` calls (no copy: the batch the loop holds anyway): the
batches of the step, and those fetched after the previous ``step_end`` and before the step began
(the ImageNet loop's ``for`` fetches there). When the step is done again, the next fetches from
the same iterator object return those batches, in order, before the iterator moves on; the
iterator itself was not advanced, so the epoch ends where it would have.

Bounds and limits:

* at most :data:`CAP` batches per iterator between two step ends (gradient accumulation of up to
  8 micro-batches); an iterator that yields more (an evaluation loop in the gap) is no longer
  kept until the next step end, and nothing of it is given back;
* a batch the loop changed in place before its forward comes back changed (the redo check then
  compares it with itself): such a loop is not bitwise, and nothing says so;
* batches drawn otherwise (nanoGPT's ``get_batch`` from torch's generator, a prefetch into a local
  variable) are not given back: the redo check fails those recoveries, as before;
* a framework's step done again inside the step (Lightning, the HF Trainer) holds its batch: no
  replay there.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from .. import compat

# batches kept per iterator between two step ends: a training loop's micro-batches
CAP = 8


class BatchReplay:
    """The batches of the loop's ``DataLoader`` iterators since the last step end, given back to a
    step done again (see the module's doc). One per Guard with in-process recovery; the first
    :meth:`install` in a process wraps, a second Guard's does nothing.

    Attributes:
        served: batches given back since the last :meth:`arm`.
    """

    def __init__(self) -> None:
        self.served = 0
        self._owner: Optional[type] = None  # the iterator class whose __next__ is ours
        self._original: Optional[Callable[[Any], Any]] = None
        self._wrapper: Optional[Callable[[Any], Any]] = None
        # id(iterator) -> (the iterator, its batches since the last step end; None: more than CAP)
        self._since_end: dict[int, tuple[Any, Optional[list[Any]]]] = {}
        self._last: dict[int, tuple[Any, Optional[list[Any]]]] = {}  # the step just ended
        self._queue: dict[int, tuple[Any, deque]] = {}  # to give back, per iterator

    def install(self) -> bool:
        """Wrap the iterators' ``__next__``; ``False`` (nothing done) where torch lacks the class
        or another Guard's replay wraps it."""
        cls = compat.dataloader_iterator_class()
        if cls is None or getattr(cls.__next__, "trainguard_replay", False):
            return False
        original = cls.__next__

        def __next__(iterator: Any) -> Any:
            return self._next(iterator, original)

        __next__.trainguard_replay = True  # type: ignore[attr-defined]
        cls.__next__ = __next__
        self._owner, self._original, self._wrapper = cls, original, __next__
        return True

    def step_ended(self) -> None:
        """``guard.step_end`` begins: the batches since the previous one are this step's."""
        self._last, self._since_end, self._queue = self._since_end, {}, {}

    def arm(self) -> int:
        """The step just ended is done again: the next fetches from each of its iterators return
        its batches, in order. Returns how many are given back."""
        self._queue = {k: (it, deque(b)) for k, (it, b) in self._last.items() if b}
        self.served = 0
        return sum(len(q) for _, q in self._queue.values())

    def close(self) -> None:
        """Put ``__next__`` back (if it is still ours) and drop every batch kept. Idempotent."""
        if self._owner is not None and self._owner.__next__ is self._wrapper:
            self._owner.__next__ = self._original
        self._owner = self._original = self._wrapper = None
        self._since_end, self._last, self._queue = {}, {}, {}

    def _next(self, iterator: Any, original: Callable[[Any], Any]) -> Any:
        held = self._queue.get(id(iterator))
        if held is not None and held[0] is iterator and held[1]:
            batch = held[1].popleft()
            self.served += 1
        else:
            batch = original(iterator)  # StopIteration at an epoch's end passes through
        self._keep(iterator, batch)
        return batch

    def _keep(self, iterator: Any, batch: Any) -> None:
        entry = self._since_end.get(id(iterator))
        if entry is None or entry[0] is not iterator:
            entry = self._since_end[id(iterator)] = (iterator, [])
        batches = entry[1]
        if batches is None:
            return
        if len(batches) >= CAP:  # not a training loop's micro-batches: keep none of it
            self._since_end[id(iterator)] = (iterator, None)
            return
        batches.append(batch)
