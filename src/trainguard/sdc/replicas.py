"""Silent data corruption: replica fingerprints compared across data-parallel ranks.

Under data parallelism (DDP, or a plain module whose gradients the script all-reduces) every rank
holds the same parameters after each optimizer step. A bit flipped by a bad GPU or bad memory
makes one replica differ, silently: no error, no NaN, and the replicas never agree again (DDP
synchronizes gradients, not parameters).

Every ``[sdc] check_interval`` steps, at the step boundary, each rank computes a **fingerprint**
of its parameters and the ranks compare them in one small all-reduce (:class:`ReplicaCheck`):

* the fingerprint is exact, not a float sum: each parameter's bytes are read as integers
  (``int32`` for 4-byte floats, ``int16`` for 2-byte ones, ``int64``/``uint8`` otherwise) and
  summed into an ``int64`` on the parameter's device (wrapping, so exact modulo 2⁶⁴). Flipping any
  one bit changes one element by ±2ᵏ, hence the sum: a single flipped bit is always seen;
* the compare is one all-reduce (max) of a vector holding each rank's fingerprint in its slot, so
  every rank sees all of them; the value most ranks hold is the good one and the others are named
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
from ..sections import SDCSection

INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_WRAP = 1 << 64


def fingerprint(params: Iterable[torch.Tensor]) -> int:
    """Exact fingerprint of ``params``: the wrapped sum of their bytes read as integers, as a signed
    64-bit value (see the module doc). Equal tensors give equal values on every device."""
    total = 0
    for p in params:
        t = p.detach()
        if t.numel() == 0:
            continue
        ints = t.contiguous().view(-1).view(INT_VIEW[t.element_size()])
        total = (total + int(ints.sum(dtype=torch.int64))) % _WRAP
    return total - _WRAP if total >= 1 << 63 else total


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
    """Compares the replicas' parameter fingerprints every ``check_interval`` steps (a collective).

    Args:
        cfg: the ``[sdc]`` section.
        model: the trained module (DDP-wrapped or plain).
        rank, world_size: this rank and the group size.
        events: the rank's event log (rank 0 writes ``sdc_check_off``).
    """

    def __init__(self, cfg: SDCSection, model: torch.nn.Module, rank: int, world_size: int, events: EventLog):
        self.cfg, self.model, self.rank, self.world_size = cfg, model, rank, world_size
        self.last_good = 0
        self.suspect: Optional[Mismatch] = None  # the mismatch whose window is being re-run
        self.values: list[int] = []  # every rank's fingerprint at the latest check
        why = self._why_off(events)
        self.active = why is None

    def renumber(self, rank: int, world_size: int) -> None:
        """This rank is ``rank`` of ``world_size`` from now on (the group shrank in place, see
        :mod:`trainguard.rejoin.shrink`)."""
        self.rank, self.world_size = rank, world_size
        self.active = self.active and world_size > 1  # one rank left: no replica to compare with
        self.values = []

    def _why_off(self, events: EventLog) -> Optional[str]:
        if self.cfg.check_interval == 0:
            return "off"  # by choice: no event
        why = None
        if self.world_size < 2:
            why = "one rank: no replica to compare with"
        elif any(type(p).__name__ == "DTensor" for p in self.model.parameters()):
            why = "sharded parameters (DTensor: FSDP2, tensor parallelism): no replicas to compare"
        if why is not None and self.rank == 0:
            events.emit("sdc_check_off", None, reason=why)
        return why

    def due(self, step: int) -> bool:
        """Whether ``step`` (completed steps) is a check step."""
        return self.active and step % self.cfg.check_interval == 0

    def check(self, step: int) -> Optional[Mismatch]:
        """Compare the fingerprints (a collective: call on every rank at the same step).

        Returns:
            ``None`` when every replica agrees (``last_good`` becomes ``step``), else the
            :class:`Mismatch` (the same on every rank).
        """
        mine = fingerprint(self.model.parameters())
        slots = [-(1 << 63)] * self.world_size
        slots[self.rank] = mine
        values = self.values = [int(v) for v in tgdist.all_reduce_max(slots)]
        ranks = odd_ones_out(values)
        if not ranks:
            self.last_good = step
            return None
        return Mismatch(step, self.last_good, ranks, values)

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
