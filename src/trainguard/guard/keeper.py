"""Keeping this rank's own state at a step boundary (:mod:`trainguard.rejoin.boundary`), for a
replacement of a lost rank to start from: the parts a rank holds alone (data position, extras,
random number generators: :data:`~trainguard.rejoin.rank.LOCAL_PARTS`).

The boundary of step ``N`` is kept just before step ``N``'s last gradient bucket is sent (after
the send a peer may complete the step without this rank). A loop can still move its own state
after that: an evaluation after the update iterates a ``DataLoader``, which draws its seed from
torch's generator; a loop that takes its next batch after the backward moves its data position.
So at the step's end the state is compared with what was kept (:meth:`Keeper.confirm`: the random
number generators by identity, copy-on-change; the rest by value) and kept again if it moved.
A rank lost between the last bucket and the step's end leaves the earlier state: the survivors
then send its replacement how their own state moved there (:meth:`Keeper.move_after_bucket`). A
generator the lost rank had at the survivors' state before the move (seeded alike on every rank)
takes their state after it (:func:`catch_up`); any other move (a generator seeded per rank, a
data position) cannot be followed, and the replacement says its resume is not bitwise.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..rejoin.rank import LOCAL_PARTS, Rejoin
from ..state.determinism import alike_across_ranks
from ..state.trainstate import TrainState

CONFIRMED = "confirmed"  # a kept state's key: kept at the step's end (True) or before its last bucket (False)


class Keeper:
    """Keeps this rank's own state as the boundary of a step.

    Args:
        rejoin: this rank's recovery state (``keeping``, ``failure``, ``keep``).
        train_state: the parts to keep (those of :data:`~trainguard.rejoin.rank.LOCAL_PARTS` it has).
    """

    def __init__(self, rejoin: Rejoin, train_state: TrainState):
        self.rejoin, self.train_state = rejoin, train_state
        self._last: Optional[dict[str, Any]] = None  # the state kept last
        # the newest step whose own state moved after its last bucket: (step, kept before, kept after)
        self._moved: Optional[tuple[int, dict[str, Any], dict[str, Any]]] = None

    def keep(self, step: int, confirmed: bool = True) -> None:
        """Keep this rank's own state as the boundary of step ``step`` (``confirmed``: at the step's
        end, not before its last gradient bucket)."""
        self._last = {"step": step, CONFIRMED: confirmed, **self.train_state.state_dict(LOCAL_PARTS)}
        self.rejoin.keep(self._last)

    def before_last_bucket(self, step: int) -> None:
        """DDP's hook or ``guard.run_step`` is about to send step ``step``'s last gradient bucket:
        keep this rank's own state as its boundary, since after the send a peer may complete the
        step (``should_step`` runs no collective when the detectors' values ride in that bucket).
        Kept again when the bucket is sent again (``run_step``'s retry after out-of-memory)."""
        if self.rejoin.keeping and self.rejoin.failure is None:
            self.keep(step, confirmed=False)

    def confirm(self, step: int) -> None:
        """Step ``step`` ended, its boundary kept before its last bucket: keep it again if this
        rank's own state moved since (about 20 µs a step when it did not, measured on this project's
        2-core machine: the generators' raw states are fingerprinted and their dict compared by
        identity, :class:`~trainguard.state.trainstate.RNGState`; the rest by value)."""
        last = self._last
        if not self.rejoin.keeping or last is None or last["step"] != step or last[CONFIRMED]:
            return
        now = self.train_state.state_dict(LOCAL_PARTS)
        if all(_same(now.get(k), v) for k, v in last.items() if k not in ("step", CONFIRMED)):
            return
        self.keep(step)
        self._moved = (step, last, self._last)

    def move_after_bucket(self, step: int) -> Optional[dict[str, Any]]:
        """How this rank's own state moved between step ``step``'s last gradient bucket and its end
        (a lost rank's boundary kept before that bucket misses the same move), for
        :func:`catch_up`: ``{"rng_before": generators, "rng_after": generators, "other": whether
        another part moved}``; ``None`` when it did not move."""
        if self._moved is None or self._moved[0] != step:
            return None
        _, before, after = self._moved
        other = any(not _same(after.get(k), v) for k, v in before.items() if k not in ("step", CONFIRMED, "rng"))
        return {"rng_before": before.get("rng"), "rng_after": after.get("rng"), "other": other}


def catch_up(own: dict[str, Any], move: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A replacement's ``own`` state, kept by the lost rank before a step's last bucket, moved as
    the survivors' ``move`` (:meth:`Keeper.move_after_bucket`): each generator that moved on the
    survivors and that the lost rank had at their state before the move (seeded alike) takes
    their state after it. ``None`` when a move cannot be followed: another part moved, or a moved
    generator of the lost rank's was elsewhere (seeded per rank)."""
    mine, before, after = own.get("rng"), move.get("rng_before") or {}, move.get("rng_after") or {}
    if move.get("other") or not isinstance(mine, dict):
        return None
    rng = dict(mine)
    for name, value in after.items():
        if equal(value, before.get(name)):
            continue  # this generator did not move
        if name not in mine or not equal(mine[name], before.get(name)) or not alike_across_ranks(name):
            return None
        rng[name] = value
    return {**own, "rng": rng}


def equal(a: Any, b: Any) -> bool:
    """Equal values, looking into dicts, lists and tuples; tensors and arrays by their elements."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or equal plain values; anything else (tensors, values that cannot say) is
    taken as moved: keeping again is always right."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 (an ambiguous comparison: a dict of tensors)
        return False
