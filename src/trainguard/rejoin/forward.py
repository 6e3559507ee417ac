"""Roll forward: a lost rank's replacement moves forward to where the survivors are, and the
survivors never rewind (``[recovery] roll_forward``; the design: docs/design.md, "In-process
recovery: roll forward").

The meeting point is the end of the backward pass whose gradient buckets lost a peer. trainguard's
DDP hook (:class:`~.catch.DDPHook`) keeps the input of each bucket it sends (:meth:`RollForward.keep`:
the bucket after its division by the group's size, with the detectors' values where they ride),
because an all-reduce that fails may leave partial sums in its buffer (gloo's ring adds in place).
At the last bucket of each pass it asks the autograd engine to call :meth:`RollForward.pass_ended`
once the pass is over, after DDP's reducer has finalized the gradients (a callback that queues a
callback: DDP queues its own finalization after trainguard's hook returns).

* **A survivor** whose bucket lost a peer completes the pass's remaining buckets on itself alone
  (kept as they would have been sent). At the pass's end ``on_lost(passes)`` runs the meeting
  (:meth:`trainguard.guard.recovering.Recovering.roll_forward`): the new group, and the state of the
  last step boundary sent to the replacement. The survivors' model and optimizer are still at that
  boundary (the update comes after the backward) and their buffers are put back to the step's
  start for the send. Then every backward pass of the step is all-reduced again from the kept
  inputs, in the order DDP sent them, over the new group (:meth:`RollForward.reduce_again`): the
  failed pass's results become the gradients; an earlier pass of the step (gradient accumulation
  without ``no_sync``) only gives the replacement its results. The survivors' loop goes on from
  inside ``loss.backward()``: nothing of it (hidden states, counters, a batch fetched ahead, a
  hand-written update, a wrapper's state) was touched, so none of it needs to be known.
* **The replacement** joins at the last boundary (its own parts from the lost rank's boundary
  file, as a resume), told how many passes the survivors reduce again (:attr:`RollForward.ahead`).
  Its loop runs the interrupted step from its top on the batch its data position gives. Until it
  has met them, its buckets complete on itself alone (kept), its script's collectives complete
  alone (:class:`~.catch.Catch` stays ``"local"``) and so does DDP's buffer broadcast; at the end
  of each of those passes it all-reduces the pass again with the survivors and its gradients take
  the results. From then on every rank runs the same collectives.

**Why the result is bitwise** that of a run without the failure: each rank's bucket input is what
it would have sent (the replacement computes the lost rank's from the same state and batch), the
new group has the same size and rank order, and the buckets go in the same order with the same
lengths, so every element is summed in the same order.

**Where it does not apply**, the step is done again as without it: a loss caught outside a backward
pass (a script's collective, ``should_step``'s check, a save), or survivors stopped at different
places (three ranks or more, a ring that completed on some: each says where in the recovery store,
and one whose peers stopped elsewhere meets them at the step's end, as without roll forward:
:meth:`~trainguard.guard.inprocess.InProcess.rolls_forward_with_all`). Declined at start, said
once: a script's own communication hook, a sharded model, a framework's loop.

Cost: one copy of each bucket per backward pass (the gradients' size, in the gradients' memory),
kept until the next step's first pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import compat


@dataclass
class Kept:
    """One gradient bucket as a rank sent it (or would have).

    Attributes:
        params: the bucket's parameters, in the bucket's order.
        offsets: each parameter's gradient's offset in the bucket (elements).
        sent: the flat bucket as sent: divided by the group's size, the detectors' values appended
            where they ride in it (two ranks).
        numel: the bucket's own elements (``sent[:numel]``).
        extra: the detectors' values all-reduced apart, right after the bucket (three ranks or
            more), else ``None``.
    """

    params: list[torch.Tensor]
    offsets: list[int]
    sent: torch.Tensor
    numel: int
    extra: Optional[torch.Tensor] = None


class RollForward:
    """The kept bucket inputs of the current step's backward passes, and the meeting at a pass's end.

    Args:
        step_in_progress: ``() -> int``, the number of the step being run (1-based).
        failed_during: ``() -> str | None``: where a lost peer was caught in this step (``None``:
            none); ``"backward"``, in its gradient buckets, makes the pass's end the meeting point.
        group: ``() -> ProcessGroup``: the group the model trains on now (DDP's ``process_group``).
        reduced: called with the detectors' summed values of the pass whose results are written.

    Attributes:
        on_lost: ``on_lost(passes)``: a survivor's meeting at the end of the pass that lost a peer
            (set by the Guard; raises what a failed recovery raises).
        on_met: ``on_met(last, at_forward)``: called on the replacement after each pass it
            all-reduced again with the survivors, ``last``: it has met them; or once with
            ``at_forward`` where it met them in its first forward's broadcast (set by the Guard).
        ahead: on a replacement, the passes still to all-reduce again with the survivors (0: none;
            -1: the survivors wait in the buffers' broadcast of its first forward).
        passes: the current step's passes, each a list of :class:`Kept` in bucket order.
        progress: trainguard's DDP hook's progress as the step's first pass began
            (:meth:`~.catch.DDPHook.progress`): a replacement starts the step from it, so that the
            detectors' values ride in the same bucket as on the survivors.
    """

    def __init__(
        self,
        step_in_progress: Callable[[], int],
        failed_during: Callable[[], Optional[str]],
        group: Callable[[], Any],
        reduced: Callable[[torch.Tensor], None],
    ):
        self.step_in_progress, self.failed_during = step_in_progress, failed_during
        self.group, self.reduced = group, reduced
        self.on_lost: Callable[[int], None] = lambda passes: None
        self.on_met: Callable[[bool, bool], None] = lambda last, at_forward: None
        self.ahead = 0
        self.passes: list[list[Kept]] = []
        self.progress = (0, 0)  # the DDP hook's progress at the step's first pass (its carrier bucket)
        self._step: Optional[int] = None
        self._engine = compat.backward_engine()

    @staticmethod
    def available() -> bool:
        """Whether the installed torch shows the autograd engine's final callbacks."""
        return compat.backward_engine() is not None

    def pass_begins(self, progress: tuple[int, int]) -> None:
        """DDP's hook got a pass's first bucket; ``progress``: where the hook stood then
        (:meth:`~.catch.DDPHook.progress`). A new step forgets the last one's passes and keeps
        it (:attr:`progress`)."""
        step = self.step_in_progress()
        if step != self._step:
            self._step, self.passes, self.progress = step, [], progress
        self.passes.append([])

    def keep(self, bucket: Any, sent: torch.Tensor, numel: int, extra: Optional[torch.Tensor]) -> None:
        """Keep a copy of ``bucket``'s input ``sent`` (before its all-reduce changes it in place)
        in the current pass."""
        base = bucket.buffer().storage_offset()
        offsets = [g.storage_offset() - base for g in bucket.gradients()]
        self.passes[-1].append(Kept(list(bucket.parameters()), offsets, sent.clone(), numel, extra))

    def alone(self) -> bool:
        """Whether this rank's buckets complete on it alone now: a replacement not yet met, or a
        lost peer in this step."""
        return self.ahead != 0 or self.failed_during() is not None

    def pass_ends(self) -> None:
        """Called in DDP's hook with the pass's last bucket: :meth:`pass_ended` runs once the pass
        is over (after DDP's finalization, which DDP queues after this)."""
        engine = self._engine
        engine.queue_callback(lambda: engine.queue_callback(self.pass_ended))

    def pass_ended(self) -> None:
        """A backward pass ended (its gradients final): a replacement not yet met all-reduces it
        again with the survivors; a survivor whose bucket lost a peer meets the replacement."""
        if self.ahead > 0:
            reduce_pass(self.passes[-1], self.group(), self.reduced, write=True)
            self.ahead -= 1
            self.on_met(self.ahead == 0, False)
        elif self.failed_during() == "backward":  # (elsewhere: the step is done again, as without it)
            self.on_lost(len(self.passes))

    def lost_at_forward(self) -> None:
        """A survivor lost a peer in the buffers' broadcast of the step's first forward (DDP's,
        trainguard's :class:`~.buffers.BufferSync`), before anything of the step was reduced: the
        meeting is there (``on_lost(-1)``); the caller broadcasts again over the new group."""
        self.on_lost(-1)

    def met_at_forward(self) -> None:
        """A replacement's first forward broadcast the buffers with survivors that met there."""
        self.ahead = 0
        self.on_met(True, True)

    def reduce_again(self) -> None:
        """A survivor at the meeting: every pass of the step all-reduced again over the new group,
        in order; the last (the one that lost the peer) becomes the gradients.

        Raises:
            torch.distributed.DistError, RuntimeError: the new group failed (the recovery fails).
        """
        for i, kept in enumerate(self.passes):
            reduce_pass(kept, self.group(), self.reduced, write=i == len(self.passes) - 1)


def reduce_pass(kept: list[Kept], group: Any, reduced: Callable[[torch.Tensor], None], write: bool) -> None:
    """All-reduce (sum) one pass's kept buckets over ``group`` in order, as trainguard's hook sent
    them (each bucket, then its values sent apart); with ``write`` the sums become the parameters'
    gradients and the detectors' values go to ``reduced``."""
    for k in kept:
        out = k.sent.clone()
        group.allreduce([out]).wait()
        values: Optional[torch.Tensor] = None
        if k.extra is not None:
            values = k.extra.clone()
            group.allreduce([values]).wait()
        elif out.numel() > k.numel:
            values = out[k.numel :]
        if not write:
            continue
        with torch.no_grad():
            for p, offset in zip(k.params, k.offsets):
                chunk = out[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
        if values is not None:
            reduced(values)
