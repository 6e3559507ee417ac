"""The data position after a resume: a loader whose position the checkpoint does not hold is said.

A resume restores what the Guard was given: the model, the optimizer, the scheduler, the sampler
and ``extra_state``. A loop that draws its batches from a ``DataLoader`` over torch's own samplers
(``RandomSampler`` with or without replacement, ``SequentialSampler``, ``DistributedSampler``, a
``BatchSampler`` over them) or an ``IterableDataset`` keeps its position in the loader's iterator,
which no checkpoint holds: the resumed process starts a new iteration (a fresh permutation, or the
first batch of the epoch) where the uninterrupted run was mid-way, and trains on other batches.

:class:`DataWatch` watches the first step of a resumed process (or of a replacement that joined
the survivors): ``DataLoader`` iterators' ``__next__`` is wrapped from :meth:`DataWatch.arm` to
the step's end (:meth:`DataWatch.disarm`), and each iterator that hands out a batch before the
model's first forward of the step (the batch the step trains on; an evaluation loader drawn later
in the step is not looked at) is checked: its sampler, the sampler inside its batch sampler or its
dataset must be an object the Guard saves (the ``sampler``, an ``extra_state`` or
``shared_state`` value). Else the cause names the loader (its dataset's and samplers' types) and
what keeps the position instead; the caller says it as ``resume_not_bitwise``. A loop that skips
to its position itself is not said: an iterator that hands out more than one batch before the
first forward (the PyTorch ImageNet example's ``if i < skip: continue``, accelerate's skipping
loaders, which the Hugging Face Trainer resumes with) or that draws through a sampler with
``skip_batches`` (accelerate's ``SkipBatchSampler``). Limits: such a loop that resumes at an
epoch's start (nothing to skip) is said all the same; a loop that draws all its micro-batches
before the first forward is taken for one that skips, and not said.

torchdata's ``StatefulDataLoader`` given as ``Guard(sampler=loader)`` keeps its own position, worker
processes included (its iterators are looked at as its own: not said). Two more causes are said:

* **Worker processes reading a saved sampler ahead.** A plain ``DataLoader`` with
  ``num_workers > 0`` takes indices from its sampler up to ``prefetch_factor * num_workers``
  batches ahead of the batch the step trains on; a saved sampler (``trainguard.ResumableSampler``)
  then holds a position ahead of the training, and a resume skips the batches read ahead.
* **A position loaded after the loader's iterator was made.** ``StatefulDataLoader.load_state_dict``
  applies at the loader's next ``iter()``; a loop that made its iterator before the Guard resumed
  (``it = iter(loader)`` above ``guard.steps()``) goes on with the iterator it has, from the
  epoch's start: the step's first batch comes from an iterator that is not the loader's own any
  more (the loaded position went to a new one).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from .. import compat

FIX = (
    "give the Guard an object that keeps it: torchdata's StatefulDataLoader given as Guard(sampler=loader) "
    "(worker processes too), or a trainguard.ResumableSampler as the DataLoader's sampler and Guard(sampler=...) "
    "with num_workers=0"
)
READ_AHEAD = (
    "the batches of this process's first step came from {what}: its worker processes take indices from the "
    "sampler the checkpoint saves up to prefetch_factor x num_workers batches ahead of the step, so the position "
    "saved was ahead of the batches trained on and this run skipped the batches read ahead; use torchdata's "
    "StatefulDataLoader as the loader and give it as Guard(sampler=loader), or num_workers=0"
)
LOADED_LATE = (
    "the data position the checkpoint holds for {what} was loaded into it but never used: the loop made the "
    "loader's iterator before the Guard resumed (an iter(loader) above guard.steps()), and that iterator started "
    "the epoch anew; make the iterator after the resume (in the loop, or after guard.begin())"
)


def stateful_loaders(known: Iterable[Any]) -> list[Any]:
    """The loaders among ``known`` that keep their own position (torchdata's ``StatefulDataLoader``:
    ``state_dict``, ``load_state_dict`` and the ``next_iter_state`` it applies at its next ``iter()``)."""
    return [obj for obj in known if hasattr(obj, "next_iter_state") and hasattr(obj, "load_state_dict")]


class LoaderPosition:
    """The position of a loader that keeps its own (torchdata's ``StatefulDataLoader``) as the
    Guard saves it: ``state_dict()`` is the loader's, except while the loader holds no iterator
    (before the loop's first ``iter()``, or after a resume loaded it): then the position loaded and
    not yet used (``{}``: the start), not a new iterator the loader would make for it. An iterator
    made so early would be made before the loop's ``sampler.set_epoch(epoch)``: the epoch's
    permutation would be the wrong one (an epoch loop resumed in its second epoch).

    Attributes:
        loader: the loader (what a resume's data check looks for, :func:`known_objects`).
    """

    def __init__(self, loader: Any):
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        if compat.stateful_loader_idle(self.loader):
            return self.loader.next_iter_state or {}
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def position_of(sampler: Any) -> Any:
    """What the Guard saves for its ``sampler``: a :class:`LoaderPosition` for a loader that keeps its
    own position, else the sampler itself."""
    return LoaderPosition(sampler) if stateful_loaders([sampler]) else sampler


def _parts_of(loader: Any) -> list[Any]:
    """The dataset and samplers of a loader that keeps its own position (its iterators draw from them)."""
    return [getattr(loader, name, None) for name in ("dataset", "sampler", "batch_sampler")]


def _describe(obj: Any) -> str:
    """``RandomSampler(replacement=True)``, ``BatchSampler over SequentialSampler``, ``TensorDataset``."""
    name = type(obj).__name__
    inner = getattr(obj, "sampler", None)
    if inner is not None and inner is not obj:
        return f"{name} over {_describe(inner)}"
    if getattr(obj, "replacement", False):
        return f"{name}(replacement=True)"
    return name


def known_objects(state: Any) -> list[Any]:
    """Every object a :class:`~trainguard.state.trainstate.TrainState` saves, nested ones included."""
    out: list[Any] = []
    for part in getattr(state, "parts", {}).values():
        out.append(part.loader if isinstance(part, LoaderPosition) else part)
        out.extend(known_objects(part))
    return out


SEED_DRAWN = (
    "the {what}'s iterator of this process's first step was made after the resume and drew its workers' seed "
    "from torch's global generator (the loader has no generator of its own), a draw the uninterrupted run did not "
    "make at this step, so every random number after it (dropout) differs; give the loader a generator of its "
    "own: {what}(..., generator=torch.Generator())"
)


UNSAVED = (
    "the batches of this process's first step came from {what}, whose position the checkpoint does not hold: "
    "its iterator started anew here, where the uninterrupted run was mid-way, so this run trains on other batches"
)


class DataWatch:
    """Names the data loaders of a resumed process's first step whose position is not saved (see
    the module doc). One per Guard; :meth:`arm` once at the loop's start, :meth:`disarm` at the
    first step's end (and at close: idempotent)."""

    def __init__(self) -> None:
        self._owner: Optional[type] = None
        self._original: Optional[Callable[[Any], Any]] = None
        self._wrapper: Optional[Callable[[Any], Any]] = None
        self._known: set[int] = set()
        self._exact: dict[int, Any] = {}  # id(what a loader keeping its own position draws from) -> the loader
        self._looking = False  # before the model's first forward of the step
        # id(iterator) -> [the loader's description ("" if its position is saved), batches drawn]
        self._seen: dict[int, list] = {}
        self._hook: Any = None
        self._report: Optional[Callable[[str], None]] = None
        self._first_draw: Optional[int] = None  # what torch's global generator draws first after arm()
        self._seeds = True  # iterators made after the resume, drawing from torch's generator, are said

    @property
    def armed(self) -> bool:
        """Whether a first step is watched (:meth:`disarm` to come)."""
        return self._report is not None

    def arm(self, model: Any, known: Iterable[Any], report: Callable[[str], None], seeds: bool = True) -> bool:
        """Watch the step about to run: ``known`` are the objects the checkpoint holds,
        ``report(cause)`` is called at :meth:`disarm` for the loaders found; ``seeds``: also an
        iterator made after this call that drew its seed from torch's global generator
        (:data:`SEED_DRAWN`: its seed is that generator's first draw since, or a
        ``StatefulDataLoader`` without a generator of its own). ``False`` (nothing watched) where
        torch lacks the iterator class."""
        cls = compat.dataloader_iterator_class()
        if cls is None or self._owner is not None:
            return False
        original = cls.__next__

        def __next__(iterator: Any) -> Any:
            batch = original(iterator)
            if self._looking:
                self._look(iterator)
            return batch

        self._owner, self._original, self._wrapper = cls, original, __next__
        cls.__next__ = __next__
        known = [obj for obj in known if obj is not None]
        self._exact = {
            id(part): loader for loader in stateful_loaders(known) for part in _parts_of(loader) if part is not None
        }
        self._known = {id(obj) for obj in known} | set(self._exact)
        self._looking, self._seen, self._report = True, {}, report
        self._seeds, self._first_draw = seeds, None
        if seeds:
            # the int64 an iterator made now would draw as its seed from torch's global generator (one copy
            # of the generator's state, ~5 KB): an iterator whose seed is that one was made after the resume
            replay = torch.Generator()
            replay.set_state(torch.get_rng_state())
            self._first_draw = int(torch.empty((), dtype=torch.int64).random_(generator=replay).item())
        if hasattr(model, "register_forward_pre_hook"):
            self._hook = model.register_forward_pre_hook(self._first_forward)
        return True

    def _first_forward(self, module: Any, args: Any) -> None:
        self._looking = False

    def _look(self, iterator: Any) -> None:
        seen = self._seen.get(id(iterator))
        if seen is not None:
            seen[1] += 1
            return
        dataset, index_sampler = compat.dataloader_iterator_source(iterator)
        chain = [index_sampler, getattr(index_sampler, "sampler", None), dataset]
        workers = compat.dataloader_iterator_workers(iterator)
        loader = next((self._exact[id(obj)] for obj in chain if obj is not None and id(obj) in self._exact), None)
        if loader is not None:  # a loader that keeps its own position: it reached this iterator, or is pending
            what = type(loader).__name__
            if not compat.stateful_loader_owns(loader, iterator):
                why = LOADED_LATE.format(what=what)
            else:  # made after the resume loaded its position: its seed came from the global generator?
                drew = self._seeds and getattr(loader, "generator", 0) is None
                why = SEED_DRAWN.format(what=what) if drew else ""
            self._seen[id(iterator)] = [why, 1]
            return
        if any(obj is not None and id(obj) in self._known for obj in chain):
            # its position is saved: exactly without worker processes, else ahead of the step
            what = f"a DataLoader with {workers} worker processes drawing with {_describe(index_sampler)}"
            if workers:
                why = READ_AHEAD.format(what=what)
            elif self._seeds and compat.dataloader_iterator_seed(iterator) == self._first_draw:  # made after the
                why = SEED_DRAWN.format(what="DataLoader")  # resume: its seed is the generator's first draw
            else:
                why = ""
            self._seen[id(iterator)] = [why, 1]
            return
        if any(getattr(obj, "skip_batches", 0) for obj in chain):  # accelerate's SkipBatchSampler
            self._seen[id(iterator)] = ["", 1]  # the loop skips to its position itself
            return
        what = "a DataLoader"
        if dataset is not None:
            what += f" over {type(dataset).__name__}"
            if index_sampler is not None:
                what += f" drawing with {_describe(index_sampler)}"
        self._seen[id(iterator)] = [f"{UNSAVED.format(what=what)}; {FIX}", 1]

    def disarm(self) -> None:
        """End the watch: put ``__next__`` back (if it is still ours), remove the forward hook,
        and report each loader found (once each)."""
        if self._owner is not None and self._owner.__next__ is self._wrapper:
            self._owner.__next__ = self._original
        if self._hook is not None:
            self._hook.remove()
        # an iterator that handed out several batches before the first forward skipped to its position
        # (the ImageNet example's `if i < skip: continue`, accelerate's skipping loaders): not said
        found = sorted({why for why, drawn in self._seen.values() if why and drawn == 1})
        report, self._report = self._report, None
        self._owner = self._original = self._wrapper = self._hook = None
        self._seen, self._looking, self._exact = {}, False, {}
        if report is not None:
            for why in found:
                report(why)
