"""A step done again must see the batch the interrupted attempt saw.

In-process recovery does a step again when a peer was lost before its update: the survivors put
their own state (data position, random number streams, the optimizer's hyperparameters, the
model's buffers) back to the step's start, and the loop runs the step once more. That is the same
step only if the loop gets its batch again. It does when the data position is the Guard's (a
sampler given to it, a batch drawn from the step number); it does not when the script iterates a
data loader of its own (``for i, (x, y) in enumerate(loader)``, timm's and the ImageNet example's
loops) or prefetches the next batch inside the step (nanoGPT): the survivor's iterator has moved
on, its step done again trains on the next batch, and the script's own counters run one ahead of
the replacement's, whose collectives then differ from the survivors' a few steps later.

:class:`RedoCheck` keeps a reference to the inputs of each step's first forward (no copy) and,
in the first forward of a step done again, compares them with the interrupted attempt's
(``torch.equal``: one comparison per input tensor, only then). Different inputs: the recovery
cannot be bitwise and the ranks may part ways, so it fails at once (``on_mismatch`` says why and
raises): the launcher restarts the group from the newest checkpoint (the progress rule), seconds
after the fault, instead of training on different data or meeting the backend's timeout later.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested tuples, lists and dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for key in sorted(obj, key=str) for t in _tensors(obj[key])]
    return []


def same_inputs(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two forwards got the same input tensors (count, shapes, dtypes and values)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y.to(x.device)) for x, y in zip(a, b)
    )


class RedoCheck:
    """Compare a step done again's first forward inputs with the interrupted attempt's (see the
    module's doc).

    Args:
        model: the model whose forward the step calls (a forward pre-hook is registered on it).
        on_mismatch: ``(why) -> None``: the step done again got other inputs; expected to raise.
    """

    def __init__(self, model: torch.nn.Module, on_mismatch: Callable[[str], None]):
        self.on_mismatch = on_mismatch
        self._fresh = True  # the next forward is the step's first
        self._redo = False  # the step in progress is done again
        self._kept: Optional[list[torch.Tensor]] = None
        self._handle: Optional[Any] = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def new_step(self) -> None:
        """A step begins (``StepStart.begin``)."""
        self._fresh = True

    def restore(self) -> None:
        """The step in progress is done again (``StepStart.restore``): the next forward is its
        first (also inside a framework's step, which runs it again without a new step's begin)
        and is compared."""
        self._redo = self._fresh = True

    def forget(self) -> None:
        """The step done again is not expected to see the same inputs (the group shrank: the data is
        split among fewer ranks now), or no step is done again (this rank abandoned the step and
        took it completed from a peer: the next step is a new one): no comparison."""
        self._redo = False

    def _before_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not self._fresh:
            return
        self._fresh = False
        inputs = _tensors((args, kwargs))
        if self._redo:
            self._redo = False
            kept = self._kept
            if kept is not None and not same_inputs(inputs, kept):
                self.on_mismatch(
                    "the step done again got other inputs than the interrupted attempt (the loop's data iterator "
                    "moved on, or it prefetches the next batch in the step): give the Guard the loop's sampler "
                    "(sampler=) or fetch each batch inside the step"
                )
        self._kept = inputs

    def close(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._kept = None
