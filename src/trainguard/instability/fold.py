"""The instability detectors' flags carried in DDP's first gradient bucket: no collective of their own.

:class:`~trainguard.instability.detect.Detector` needs, per step, the sum over ranks of each rank's
loss and of its non-finite flags. With a DDP model those can ride in an all-reduce the step runs
anyway: trainguard's communication hook (:class:`~trainguard.rejoin.catch.DDPHook`) appends
:data:`SIZE` values to the *first* bucket it sends (DDP caps that bucket at 1 MiB, so the copy is
small; the forward, hence the loss, is done by then) and hands the reduced values back here:

    [loss or 0, loss non-finite, (rank+1)·loss non-finite, 1 (a loss was noted), 1 (last step's matched)]

The gradient norm needs no sum: after DDP's all-reduce every rank holds the same gradients, so
each computes the same norm (for two ranks the old mean of equal values was that value exactly;
with more, the mean's last bit could differ from it).

Which loss: the 0-dim tensor that ``backward()`` was last called on (noted by a wrapper of
``torch.Tensor.backward``), since the hook runs inside it and never sees ``should_step``'s
argument. The folded sums are used (:meth:`LossFold.usable`) only when *every* rank noted a loss and, at
the previous step, every rank's ``should_step`` loss was the very tensor its ``backward()`` ran on
(the README's loop: ``loss.backward()`` then ``guard.should_step(loss)``). Both facts travel in the
bucket, so every rank makes the same choice and no rank calls an all-reduce the others skip. A
loop whose ``backward()`` runs on another tensor (AMP's ``scaler.scale(loss)``, gradient
accumulation, the frameworks) keeps today's all-reduce: its first step never matched. A loop that
changes its shape mid-run is judged once on the backward's tensor, and said so.

Not folded: buckets of another dtype than float32 (a bf16 bucket would round the loss), a DDP model
without trainguard's hook (in-process recovery off, or a hook of the script's own).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from .. import console

SIZE = 5  # values appended to the first bucket (see the module doc)
_original_backward: Optional[Callable[..., Any]] = None
_noted: Optional[weakref.ref] = None  # the last 0-dim tensor backward() ran on


def _noting_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    global _noted
    if self.dim() == 0:
        _noted = weakref.ref(self)
    return _original_backward(self, *args, **kwargs)


def note_backward() -> None:
    """Wrap ``torch.Tensor.backward`` in this process so that the tensor it runs on is noted
    (idempotent; :func:`stop_noting` puts the original back)."""
    global _original_backward
    if _original_backward is None:
        _original_backward = torch.Tensor.backward
        torch.Tensor.backward = _noting_backward


def stop_noting() -> None:
    """Put ``torch.Tensor.backward`` back."""
    global _original_backward, _noted
    if _original_backward is not None:
        torch.Tensor.backward = _original_backward
        _original_backward, _noted = None, None


class LossFold:
    """One rank's side of the fold.

    Args:
        rank: this rank (its non-finite flag is weighted by ``rank + 1``, as the detector's own
            all-reduce does, to name a single bad rank).
    """

    def __init__(self, rank: int):
        self.rank = rank
        self._sent: Optional[tuple[int, Optional[torch.Tensor]]] = None  # (step, the loss folded)
        self._reduced: Optional[tuple[int, torch.Tensor]] = None  # (step, the summed values)
        self._matched = False  # at the last step taken, should_step's loss was the one folded
        self._said = False
        self._mine = False  # this step's should_step loss is the one folded
        self.wired = False  # a DDP hook carries the values (wire())
        self._taken = 0  # steps whose values were taken

    def wire(self) -> None:
        """A DDP communication hook calls :meth:`extra` and :meth:`reduced` from now on: note the
        tensor each ``backward()`` runs on."""
        note_backward()
        self.wired = True

    def close(self) -> None:
        """Stop noting (``torch.Tensor.backward`` as it was). Safe to call twice."""
        if self.wired:
            stop_noting()
            self.wired = False

    def extra(self, step: int, bucket: torch.Tensor) -> Optional[torch.Tensor]:
        """The values to append to step ``step``'s first bucket (``bucket``: its buffer), or
        ``None`` for a bucket that is not float32 (the same on every rank)."""
        if bucket.dtype != torch.float32:
            return None
        loss = _noted() if _noted is not None else None
        self._sent = (step, loss)
        values = torch.zeros(SIZE, dtype=bucket.dtype, device=bucket.device)
        if loss is not None:
            v = loss.detach().to(device=bucket.device, dtype=bucket.dtype)
            bad = v.isfinite().logical_not()
            values[0] = v.nan_to_num(0.0, 0.0, 0.0)
            values[1] = bad
            values[2] = bad * (self.rank + 1)
            values[3] = 1.0
        values[4] = float(self._matched)
        return values

    def reduced(self, step: int, values: torch.Tensor) -> None:
        """The hook's all-reduce of step ``step``'s first bucket completed: ``values`` are the sums."""
        self._reduced = (step, values)

    def take(self, step: int, loss: Any) -> Optional[torch.Tensor]:
        """For ``should_step(loss)`` of step ``step``: the :data:`SIZE` summed values of its first
        bucket (a tensor, not yet on the host), ``None`` if the bucket carried none this step (the
        same on every rank). Whether they may be used, :meth:`usable` says once they are on the host."""
        reduced, self._reduced = self._reduced, None
        sent = self._sent
        self._mine = sent is not None and sent[0] == step and sent[1] is not None and sent[1] is loss
        if reduced is None or reduced[0] != step:
            self._matched = False  # no fold this step (the same on every rank): start over
            return None
        self._matched = self._mine
        return reduced[1]

    def usable(self, values: list[float], world_size: int) -> bool:
        """Whether the taken ``values`` (on the host) stand for the step's losses: every rank noted
        a loss and every rank's loss matched at the previous step (the same answer on every rank).
        Says once when this rank's ``should_step`` loss was not the one folded."""
        usable = values[3] == world_size and values[4] == world_size
        self._taken += 1
        if not usable and self._taken == 2 and self.rank == 0:  # the first step never is
            console.say(
                "should_step() all-reduces the detectors' values once a step: its loss is not the "
                "tensor backward() ran on (AMP's scaler.scale(loss), gradient accumulation), so they "
                "cannot ride in DDP's first gradient bucket"
            )
        if usable and not self._mine and not self._said and self.rank == 0:
            self._said = True
            console.say(
                "should_step() got another loss than the tensor backward() ran on: this step's "
                "instability check used the latter; the next step all-reduces its own"
            )
        return usable
