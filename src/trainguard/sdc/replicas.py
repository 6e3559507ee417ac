"""Silent data corruption: replica fingerprints compared across data-parallel ranks.

Under data parallelism (DDP, or a plain module whose gradients the script all-reduces) every rank
holds the same parameters after each optimizer step. A bit flipped by a bad GPU or bad memory
makes one replica differ, silently: no error, no NaN, and the replicas never agree again (DDP
synchronizes gradients, not parameters).

Every ``[sdc] check_interval`` steps, at the step boundary, each rank computes a **fingerprint**
of its parameters and the ranks compare them (:class:`ReplicaCheck`): in the next step's first
DDP gradient bucket where trainguard's DDP hook carries the detectors' values (no collective of
its own; the verdict then comes at the next step boundary), else in one small all-reduce:

* the fingerprint is exact, not a float sum: each parameter's bytes are read as integers
  (``int32`` for 4-byte floats, ``int16`` for 2-byte ones, ``int64``/``uint8`` otherwise) and
  summed into an ``int64`` on the parameter's device (wrapping, so exact modulo 2⁶⁴). Flipping any
  one bit changes one element by ±2ᵏ, hence the sum: a single flipped bit is always seen;
* the compare sees a vector holding each rank's fingerprint in its slot (an all-reduce (max), or
  three exact float32 chunks per rank in the gradient bucket's sum), so every rank sees all of them; the value most ranks hold is the good one and the others are named
  (with 2 ranks there is no majority: both are named);
* cost: one read of the parameters per check and one all-reduce of ``world_size`` integers:
  7.5 ms for the example GPT's 3.3 M parameters on one CPU thread, against its 0.57 s step under
  DDP on 2 CPU ranks, so 1.00013× the step time at the default interval of 100 steps
  (``benchmarks/sdc_overhead.py``; the goal was ≤ 1.005×).

**Re-run to classify.** With ``on_mismatch = "rerun"`` the ranks re-run the steps from the
last checkpoint where the replicas agreed up to the failed check (:meth:`ReplicaCheck.verdict`):

* the replicas agree this time: a **transient** fault (a flipped bit that the reload replaced);
* the same ranks differ again at the same check: a **persistent** fault of those ranks' hardware
  (their hosts are excluded, ``[sdc] on_persistent``);
* a bad batch or a diverging model shows on every replica alike, so it never makes the replicas
  differ: the instability detectors of ``guard.should_step()`` see it (data, not hardware).

Models whose parameters are sharded (DTensor: FSDP2, tensor parallelism) have no replicas to
compare: the check is off for them (the ``sdc_check_off`` event says why), as on one rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .. import dist as tgdist
from ..events import EventLog
from ..ranks import RankView
from ..sections import SDCSection

INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_WRAP = 1 << 64


def fingerprint_tensor(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Exact fingerprint of ``params`` as a 0-dim ``int64`` tensor on their device, with no
    device→host copy (parameters on several devices: summed on the CPU): the sum of their bytes
    read as integers, modulo 2⁶⁴: ``int64`` addition wraps (two's complement) on the CPU and CUDA,
    which is the definition (see the module doc; tested against the exact sum)."""
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        t = p.detach()
        if t.numel() == 0:
            continue
        ints = t.contiguous().view(-1).view(INT_VIEW[t.element_size()])
        sums.setdefault(t.device, []).append(ints.sum(dtype=torch.int64))
    totals = [torch.stack(on_device).sum() for on_device in sums.values()]
    if len(totals) == 1:
        return totals[0]
    return torch.stack([t.cpu() for t in totals]).sum() if totals else torch.zeros((), dtype=torch.int64)


def fingerprint(params: Iterable[torch.Tensor]) -> int:
    """:func:`fingerprint_tensor` as a (signed 64-bit) Python int: equal tensors give equal values
    on every device."""
    return int(fingerprint_tensor(params))


CHUNK_BITS = (22, 22, 20)  # a fingerprint's 64 bits as three integers below 2**24: exact in float32


def chunks(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim ``int64`` fingerprint as three non-negative integers below 2²⁴ (``int64``, on its
    device, no host copy), low bits first, so that it rides exactly in a float32 gradient bucket
    (:mod:`trainguard.instability.fold`); :func:`from_chunks` puts it back together."""
    out, shift = [], 0
    for bits in CHUNK_BITS:
        out.append((value >> shift) & ((1 << bits) - 1))
        shift += bits
    return torch.stack(out)


def from_chunks(parts: Iterable[float]) -> int:
    """The signed 64-bit fingerprint that :func:`chunks` cut into ``parts``."""
    u, shift = 0, 0
    for c, bits in zip(parts, CHUNK_BITS):
        u |= int(c) << shift
        shift += bits
    return u - _WRAP if u >= 1 << 63 else u


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 20) -> None:
    """Flip bit ``bit`` of element ``index`` (of the flattened tensor) in place: a real bit flip in
    a real tensor, as a bad GPU would make (fault injection ``sdc``)."""
    flat = t.detach().view(-1).view(INT_VIEW[t.element_size()])
    flat[index : index + 1].bitwise_xor_(1 << bit)


def odd_ones_out(values: list[int]) -> list[int]:
    """The positions (ranks) whose value differs from the one most positions hold; with a tie for
    the most (2 ranks that differ, say), every position not in the largest group that comes first."""
    counts = Counter(values).most_common()
    if len(counts) == 1:
        return []
    top = [v for v, n in counts if n == counts[0][1]]
    if len(top) > 1:  # no majority: nobody can be trusted over the others
        return list(range(len(values)))
    return [r for r, v in enumerate(values) if v != top[0]]


@dataclass(frozen=True)
class Mismatch:
    """The replicas differ at a check.

    Attributes:
        step: completed steps at the failed check.
        last_good: completed steps at the last check where they agreed (0: none passed yet).
        ranks: the ranks whose fingerprint differs from the majority (every rank with no majority).
        fingerprints: every rank's fingerprint, by rank.
    """

    step: int
    last_good: int
    ranks: list[int]
    fingerprints: list[int]


class ReplicaCheck:
    """Compares the replicas' parameter fingerprints every ``check_interval`` steps.

    Two ways, the same verdicts: :meth:`check` compares at once (an all-reduce of its own); or
    :meth:`stash` notes this rank's fingerprint at the check step and :meth:`settle` compares it at
    the next step boundary, with every rank's fingerprint carried in that step's first DDP gradient
    bucket (:meth:`carry`, :mod:`trainguard.instability.fold`), or by the same all-reduce where the
    bucket did not carry them. The parameters are read at the check step either way; only the
    verdict comes one step later (after that step's update).

    Args:
        cfg: the ``[sdc]`` section.
        model: the trained module (DDP-wrapped or plain).
        world: this rank and the group size, read at each use (:class:`~trainguard.ranks.RankView`:
            the Guard's shared world, which a shrink changes; :meth:`group_resized` then).
        events: the rank's event log (rank 0 writes ``sdc_check_off``).
    """

    def __init__(self, cfg: SDCSection, model: torch.nn.Module, world: RankView, events: EventLog):
        self.cfg, self.model, self.world = cfg, model, world
        self.last_good = 0
        self.suspect: Optional[Mismatch] = None  # the mismatch whose window is being re-run
        self.values: list[int] = []  # every rank's fingerprint at the latest check
        self.pending: Optional[tuple[int, torch.Tensor]] = None  # (check step, this rank's fingerprint) to settle
        why = self._why_off(events)
        self.active = why is None

    def group_resized(self) -> None:
        """The group changed size in place (``world`` holds the new rank and size): the old group's
        fingerprints are dropped; one rank left has no replica to compare with (the check is off)."""
        self.active = self.active and self.world.world_size > 1
        self.values, self.pending = [], None

    def _why_off(self, events: EventLog) -> Optional[str]:
        if self.cfg.check_interval == 0:
            return "off"  # by choice: no event
        why = None
        if self.world.world_size < 2:
            why = "one rank: no replica to compare with"
        elif any(type(p).__name__ == "DTensor" for p in self.model.parameters()):
            why = "sharded parameters (DTensor: FSDP2, tensor parallelism): no replicas to compare"
        if why is not None and self.world.rank == 0:
            events.emit("sdc_check_off", None, reason=why)
        return why

    def begin(self, completed: int) -> None:
        """Training starts after ``completed`` steps (the Guard's component protocol): every replica
        holds the state it resumed from (or, a replacement, the survivors' state), where they agree."""
        self.last_good = completed

    def due(self, step: int) -> bool:
        """Whether ``step`` (completed steps) is a check step."""
        return self.active and step % self.cfg.check_interval == 0

    def check(self, step: int) -> Optional[Mismatch]:
        """Compare the fingerprints now (a collective: call on every rank at the same step).

        Returns:
            ``None`` when every replica agrees (``last_good`` becomes ``step``), else the
            :class:`Mismatch` (the same on every rank).
        """
        self.stash(step)
        return self.settle(None)[1]

    def stash(self, step: int) -> None:
        """Read this rank's fingerprint at check step ``step`` (no collective); :meth:`settle`
        compares it."""
        self.pending = (step, fingerprint_tensor(self.model.parameters()))

    def forget(self) -> None:
        """Drop a stashed fingerprint unsettled: the state moved elsewhere on every rank (a rollback,
        a regrouping whose newcomers hold none). The next check step compares again."""
        self.pending = None

    def carry(self, step: int) -> Optional[torch.Tensor]:
        """The fingerprint (0-dim ``int64``, on the parameters' device) to carry in step number
        ``step``'s gradient buckets: the one stashed at the step before it, else ``None``.
        (Called from the DDP hook, in the backward.)"""
        pending = self.pending
        return pending[1] if pending is not None and pending[0] == step - 1 else None

    def settle(self, carried: Optional[list[int]]) -> tuple[int, Optional[Mismatch]]:
        """Compare the stashed fingerprints: ``carried`` holds every rank's (by rank) where a
        gradient bucket brought them; ``None``: an all-reduce of its own (a collective: every rank
        then calls it at the same point, as every rank stashed at the same step).

        Returns:
            ``(check step, mismatch)``: as :meth:`check` for that step.
        Raises:
            RuntimeError: ``settle`` with nothing stashed.
        """
        if self.pending is None:
            raise RuntimeError("ReplicaCheck.settle(): no fingerprint stashed")
        (step, mine), self.pending = self.pending, None
        if carried is None:
            slots = [-(1 << 63)] * self.world.world_size
            slots[self.world.rank] = int(mine)
            carried = tgdist.all_reduce_max(slots)
        values = self.values = [int(v) for v in carried]
        ranks = odd_ones_out(values)
        if not ranks:
            self.last_good = step
            return step, None
        return step, Mismatch(step, self.last_good, ranks, values)

    def verdict(self, step: int, mismatch: Optional[Mismatch]) -> Optional[str]:
        """After a check at ``step`` (``mismatch`` its result): ``"transient"`` or ``"persistent"``
        when this check ends the re-run of an earlier mismatch's window (see the module doc), else
        ``None``. A new mismatch becomes the suspect whose window the caller re-runs."""
        suspect = self.suspect
        if suspect is not None and step == suspect.step:
            self.suspect = None
            if mismatch is None:
                return "transient"
            if mismatch.ranks == suspect.ranks:
                return "persistent"
        if mismatch is not None:
            self.suspect = mismatch
        return None
