"""The instability detectors' values carried in a DDP gradient bucket: no collective of their own.

:class:`~trainguard.instability.detect.Detector` needs, per step, every rank's loss. With a DDP
model they ride in an all-reduce the step runs anyway: trainguard's communication hook
(:class:`~trainguard.rejoin.catch.DDPHook`) appends ``8 × world_size + 11`` values to one bucket
(its *carrier*: the first bucket DDP sends, at most 1 MiB, until the bucket layout is known, then
the smallest bucket, so that the copy the appending costs is small; every bucket is sent after
the forward, hence the loss, is done) and hands the reduced values back here. Their layout is
declared once, in :mod:`.foldlayout` (:data:`~.foldlayout.FIELDS`, :class:`~.foldlayout.FoldLayout`)::

    loss[n] noted matched stop_sent stop_flags[5] grow next_interval[n]
    fingerprint_sent fingerprint[3n] straggler_sent straggler[3n]

The fields from ``stop_sent`` to ``next_interval`` are the stop check's flags (:class:`~trainguard.stop.conditions.StopFlags`)
on the steps where it is due (the step is agreed by every rank): the 0/1 flags summed (more than
0: set on some rank, as the check's max), ``grow`` set by rank 0 alone, the proposed next check
interval per rank (its maximum is taken). With them the stop check needs no all-reduce either
(:meth:`LossFold.stop_flags`). They are this rank's flags when its backward starts, not at the
step's end: a signal that comes later in the step is seen at the next check.

The last line is the silent-data-corruption replica check's (:class:`~trainguard.sdc.replicas.ReplicaCheck`)
at the step after a check step: each rank's parameter fingerprint read at the check step, a
64-bit integer cut into three integers below 2²⁴ (exact in float32), in its own slots
(:meth:`LossFold.fingerprints`). With them the replica check needs no all-reduce either.

On the stop checks that carry a straggler report (:class:`~trainguard.health.straggler.StragglerDetector`,
every ``[straggler] report_interval``) each rank's timings ride in its own three slots
(:meth:`LossFold.straggler`): integers of µs and score × 10⁴, exact in float32 below 2²⁴ µs
(16.7 s; above, rounded to float32, a relative 6 × 10⁻⁸, the same on every rank). The window then
closes at the step before the report step (the bucket is sent before the step ends).

Each rank writes its loss into its own slot and zeros elsewhere, so the sum is every rank's loss
exactly, NaN and infinity included (``x + 0 = x``): the same values, bit for bit, as the
detectors' own all-reduce of the same slots (:meth:`Detector.observe`), whichever way the
transport adds. The gradient norm needs no sum: after DDP's all-reduce every rank holds the same
gradients, so each computes the same norm, and a non-finite gradient on one rank before the
all-reduce is non-finite on all after it.

What the fold cannot see: a gradient changed on one rank *after* the all-reduce (a bad GPU
computing wrong numbers): that rank alone would judge it. That is silent data corruption, which
the replica check (:mod:`trainguard.sdc.replicas`) finds; the fault injector's numeric faults are
applied before the all-reduce for that reason (:meth:`~trainguard.faults.FaultInjector.at_backward`),
where real NaNs and spikes arise.

Which loss: the 0-dim tensor that ``backward()`` was last called on (noted by a wrapper of
``torch.Tensor.backward``), since the hook runs inside it and never sees ``should_step``'s
argument. The folded values are used (:meth:`LossFold.usable`) only when *every* rank noted a
loss and, at the previous step, every rank's ``should_step`` loss was the very tensor its
``backward()`` ran on (the README's loop: ``loss.backward()`` then ``guard.should_step(loss)``).
Both facts travel in the bucket, so every rank makes the same choice and no rank calls an
all-reduce the others skip. A loop whose ``backward()`` runs on another tensor (AMP's
``scaler.scale(loss)``, gradient accumulation) keeps the detectors' all-reduce: its first step
never matched; the console says so once.

``guard.run_step`` averages a DDP model's gradients itself (:class:`~trainguard.oom.sync.GradSync`)
and carries the same values in its last bucket; the loss there is the batch's total that
``run_step`` returns (:func:`pin`), so its loop folds too.

Not folded: buckets of another dtype than float32 (a bf16 bucket would round the loss), a DDP model
with a communication hook of the script's own, a plain module. An FSDP2 model carries the same
values in ``clip_grad_norm_``'s all-reduce instead (:mod:`.clipfold`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import numpy
import torch

from .. import console
from ..ranks import RankView
from ..sdc.replicas import chunks, from_chunks
from .foldlayout import FoldLayout

_original_backward: Optional[Callable[..., Any]] = None
_noted: Optional[tuple[weakref.ref, float]] = None  # the last 0-dim tensor backward() ran on, its loss factor
_inject: Optional[Callable[[], tuple[float, float]]] = None  # the fault injector's (loss, gradient) factors
_pinned: Optional[torch.Tensor] = None  # noted instead of the backward's tensor (guard.run_step's total)


def _noting_backward(self: torch.Tensor, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
    global _noted
    if self.dim() == 0:
        loss_f, grad_f = _inject() if _inject is not None else (1.0, 1.0)
        _noted = (weakref.ref(self if _pinned is None else _pinned), loss_f)
        if grad_f != 1.0:
            gradient = (torch.ones_like(self) if gradient is None else gradient) * grad_f
    return _original_backward(self, gradient, *args, **kwargs)


def note_backward(inject: Optional[Callable[[], tuple[float, float]]] = None) -> None:
    """Wrap ``torch.Tensor.backward`` in this process so that the 0-dim tensor it runs on is noted
    (idempotent; :func:`stop_noting` puts the original back). ``inject()``, if given, is asked at
    each such backward for ``(loss factor, gradient factor)``: the fault injector's numeric faults
    (the backward then runs with ``gradient = gradient factor``; the noted loss is × loss factor)."""
    global _original_backward, _inject
    _inject = inject
    if _original_backward is None:
        _original_backward = torch.Tensor.backward
        torch.Tensor.backward = _noting_backward


def stop_noting() -> None:
    """Put ``torch.Tensor.backward`` back."""
    global _original_backward, _noted, _inject
    if _original_backward is not None:
        torch.Tensor.backward = _original_backward
    _original_backward, _noted, _inject = None, None, None


def pin(loss: Optional[torch.Tensor]) -> None:
    """Note ``loss`` instead of the tensor the next ``backward()`` calls run on, until ``pin(None)``:
    ``guard.run_step`` backs each micro-batch's share but returns (and hands to ``should_step``)
    the batch's total."""
    global _pinned
    _pinned = loss


def noted_loss() -> Optional[tuple[torch.Tensor, float]]:
    """The last 0-dim tensor ``backward()`` ran on (if it is still alive) and its loss factor."""
    if _noted is None:
        return None
    loss = _noted[0]()
    return None if loss is None else (loss, _noted[1])


class LossFold:
    """One rank's side of the fold.

    Args:
        world: this rank and the group's size, read at each use (the slots;
            :class:`~trainguard.ranks.RankView`: the Guard's shared world; :meth:`group_resized`
            after a shrink or growth changed it).
    """

    def __init__(self, world: RankView):
        self.world = world
        self.layout = FoldLayout.of(world.world_size)  # where each value lies in the carried vector
        self._sent: Optional[tuple[int, Optional[torch.Tensor]]] = None  # (step, the loss folded)
        self._host: Optional[tuple[int, list[float]]] = None  # (step, the summed values on the host)
        self._stop_source: Optional[Callable[[int], Optional[list[int]]]] = None  # this rank's packed stop flags
        self._fingerprint_source: Optional[Callable[[int], Optional[torch.Tensor]]] = None  # its replica fingerprint
        self._straggler_source: Optional[Callable[[int], Optional[list[int]]]] = None  # its straggler timings
        self._reduced: Optional[tuple[int, torch.Tensor]] = None  # (step, the summed values)
        self._matched = False  # at the last step taken, should_step's loss was the one folded
        self._mine = False  # this step's should_step loss is the one folded
        self._taken = 0  # steps whose values were taken
        self._said = False
        self.wired = False  # a DDP hook (or FSDP2's clip_grad_norm_) carries the values (wire())
        self.carrier = ""  # what carries them, for the console (wire())
        self._host_np: Any = None  # the host buffer of extra() (_host_values)
        self._host_t = torch.zeros(0)  # the same memory, as a tensor

    @property
    def size(self) -> int:
        """Values appended to the carrying bucket (see the module doc): ``8 × world size + 11``."""
        return self.layout.size

    def group_resized(self) -> None:
        """The group changed size in place (``world`` holds the new rank and size): the values are
        laid out for the new size, and the next step all-reduces (no rank has matched in the new
        group yet)."""
        self.layout = FoldLayout.of(self.world.world_size)
        self._matched, self._sent, self._reduced, self._host = False, None, None, None

    def connect(
        self,
        *,
        stop: Optional[Callable[[int], Optional[list[int]]]] = None,
        fingerprint: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
        straggler: Optional[Callable[[int], Optional[list[int]]]] = None,
    ) -> None:
        """Where this rank's other values come from, once a hook carries the fold (after
        :meth:`wire`; called once): each is called with the step number in progress at
        :meth:`extra` and gives ``None`` when it has nothing to send then (an absent source: never).

        Args:
            stop: this rank's packed stop flags (``StopFlags.pack()``: 5 flags, next interval, grow).
            fingerprint: this rank's replica fingerprint (a 64-bit integer tensor).
            straggler: this rank's straggler timings (``StragglerDetector.pack()``).
        """
        self._stop_source, self._fingerprint_source, self._straggler_source = stop, fingerprint, straggler

    @property
    def carries_fingerprints(self) -> bool:
        """Whether the replica fingerprints ride in the carrying bucket (:meth:`connect` ran)."""
        return self._fingerprint_source is not None

    def wire(
        self,
        inject: Optional[Callable[[], tuple[float, float]]] = None,
        carrier: str = "a gradient bucket (DDP's, or guard.run_step's)",
    ) -> None:
        """A DDP communication hook (or :mod:`.clipfold`'s ``clip_grad_norm_``: ``carrier`` names
        it for the console) calls :meth:`extra` and :meth:`reduced` from now on: note the tensor
        each ``backward()`` runs on (``inject``: see :func:`note_backward`)."""
        note_backward(inject)
        self.wired, self.carrier = True, carrier

    def close(self) -> None:
        """Stop noting (``torch.Tensor.backward`` as it was). Safe to call twice."""
        if self.wired:
            stop_noting()
            self.wired = False

    def extra(self, step: int, bucket: torch.Tensor) -> Optional[torch.Tensor]:
        """The values to append to step ``step``'s carrying bucket (``bucket``: its buffer), or
        ``None`` for a bucket that is not float32 (the same on every rank).

        On a CPU bucket the tensor returned is this fold's own buffer, filled in place (a
        ``torch.tensor`` built from a list costs more than the rest of this method): valid until
        the next call, so callers copy it (``torch.cat``, a slice assignment), as they all do."""
        noted = noted_loss()
        self._sent = (step, noted[0] if noted is not None else None)
        if bucket.dtype != torch.float32:
            return None
        at, me = self.layout, self.world.rank
        host = self._host_values()
        host[at.index("noted")], host[at.index("matched")] = float(noted is not None), float(self._matched)
        flags = self._stop_source(step) if self._stop_source is not None else None
        if flags is not None:  # StopFlags.pack(): 5 flags, next_interval, grow
            host[at.index("stop_sent")] = 1.0
            host[at.slot("stop_flags")] = flags[:5]
            host[at.index("grow")] = flags[6]
            host[at.index("next_interval", me)] = flags[5]
        fp = self._fingerprint_source(step) if self._fingerprint_source is not None else None
        host[at.index("fingerprint_sent")] = float(fp is not None)
        timings = self._straggler_source(step) if self._straggler_source is not None else None
        if timings is not None:  # StragglerDetector.pack(): slowest, medians by rank, scores by rank
            n = self.layout.world_size
            host[at.index("straggler_sent")] = 1.0
            host[at.slot("straggler", me)] = [timings[0], timings[1 + me], timings[1 + n + me]]
        on_cpu = bucket.device.type == "cpu"
        if noted is not None and on_cpu and noted[1] == 1.0:  # into the buffer's slot (a view), as the index below
            self._host_t[at.slot("loss", me)].copy_(noted[0].detach().reshape(1))
            noted = None
        values = self._host_t if on_cpu else self._host_t.to(bucket.device)  # one copy to the bucket's device
        if noted is not None:  # device values: no host copy
            loss, factor = noted
            v = loss.detach().to(device=bucket.device, dtype=bucket.dtype)
            values[at.index("loss", me)] = v if factor == 1.0 else v * factor
        if fp is not None:
            values[at.slot("fingerprint", me)] = chunks(fp).to(device=values.device, dtype=values.dtype)
        return values

    def _host_values(self) -> Any:
        """This fold's host buffer of :attr:`size` float32 zeros (a NumPy array; :attr:`_host_t`
        is the same memory as a tensor), made again when the size changed (:meth:`group_resized`)."""
        if self._host_np is None or self._host_np.shape[0] != self.size:
            self._host_np = numpy.zeros(self.size, dtype=numpy.float32)
            self._host_t = torch.from_numpy(self._host_np)
        else:
            self._host_np.fill(0.0)
        return self._host_np

    def reduced(self, step: int, values: torch.Tensor) -> None:
        """The hook's all-reduce of step ``step``'s carrying bucket completed: ``values`` are the sums."""
        self._reduced = (step, values)

    def take(self, step: int, loss: Any) -> Optional[torch.Tensor]:
        """For ``should_step(loss)`` of step ``step``: the :attr:`size` summed values of its first
        bucket (a tensor, not yet on the host), ``None`` if the bucket carried none this step (the
        same on every rank). Whether they may be used, :meth:`usable` says once they are on the host."""
        reduced, self._reduced = self._reduced, None
        sent = self._sent
        self._mine = sent is not None and sent[0] == step and sent[1] is not None and sent[1] is loss
        self._taken += 1
        self._host = None
        if reduced is None or reduced[0] != step or reduced[1].numel() != self.size:
            self._matched = False  # no fold this step (the same on every rank): start over
            self._say_unused(f"{self.carrier} did not carry them")
            return None
        self._matched = self._mine
        self._host = (step, [])  # filled by usable()
        return reduced[1]

    def usable(self, values: list[float]) -> bool:
        """Whether the taken ``values`` (on the host) stand for the step's losses: every rank noted
        a loss and every rank's loss matched at the previous step (the same answer on every rank).
        Says once when they cannot be used for this loop."""
        n, at = self.layout.world_size, self.layout
        if self._host is not None:
            self._host = (self._host[0], values)
        usable = values[at.index("noted")] == n and values[at.index("matched")] == n
        if not usable:
            self._say_unused(
                "should_step()'s loss is not the tensor backward() ran on (AMP's scaler.scale(loss), "
                "gradient accumulation), so they cannot ride in a DDP gradient bucket"
            )
        if usable and not self._mine and not self._said and self.world.rank == 0:
            self._said = True
            console.say(
                "should_step() got another loss than the tensor backward() ran on: this step's "
                "instability check used the latter; the next step all-reduces its own"
            )
        return usable

    def _say_unused(self, why: str) -> None:
        """Once, at the second step (the first never uses the bucket): the detectors all-reduce."""
        if self._taken == 2 and self.world.rank == 0:
            console.say(f"should_step() all-reduces the detectors' values once a step: {why}")

    def _values(self, step: int) -> Optional[list[float]]:
        """Step ``step``'s summed values on the host (a device→host copy only where ``should_step``
        did not make one), ``None`` when its bucket carried none."""
        if self._host is not None and self._host[0] == step and self._host[1]:
            return self._host[1]
        if self._reduced is not None and self._reduced[0] == step and self._reduced[1].numel() == self.size:
            self._host = (step, self._reduced[1].tolist())
            return self._host[1]
        return None

    def stop_flags(self, step: int) -> Optional[list[int]]:
        """The stop check of step ``step`` from its carrying bucket: ``StopFlags.pack()`` order,
        combined over the ranks as the check's all-reduce (max) would; ``None`` when not every rank
        sent its flags in it (no bucket this step, or a rank that wanted the all-reduce: the same
        answer on every rank)."""
        values = self._values(step)
        if values is None:
            return None
        at = self.layout
        if values[at.index("stop_sent")] != self.layout.world_size:
            return None
        flags = [int(v > 0) for v in values[at.slot("stop_flags")]]
        return [*flags, int(max(values[at.slot("next_interval")])), int(values[at.index("grow")])]

    def fingerprints(self, step: int) -> Optional[list[int]]:
        """Every rank's replica fingerprint (by rank) carried in step ``step``'s carrying bucket, or
        ``None`` when not every rank sent one (no bucket this step: the same answer on every rank)."""
        values, n, at = self._values(step), self.layout.world_size, self.layout
        if values is None or values[at.index("fingerprint_sent")] != n:
            return None
        return [from_chunks(values[at.slot("fingerprint", r)]) for r in range(n)]

    def straggler(self, step: int) -> Optional[list[int]]:
        """The straggler report's exchange of step ``step`` from its carrying bucket, in
        ``StragglerDetector.pack()`` order as the stop check's all-reduce (max) would give it (the
        slowest step: the largest rank's), or ``None`` when not every rank sent its timings (the
        same answer on every rank)."""
        values, n, at = self._values(step), self.layout.world_size, self.layout
        if values is None or values[at.index("straggler_sent")] != n:
            return None
        slots = [[int(v) for v in values[at.slot("straggler", r)]] for r in range(n)]
        return [max(s[0] for s in slots)] + [s[1] for s in slots] + [s[2] for s in slots]
