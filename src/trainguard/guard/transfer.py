"""Moving the state of a survivor to the ranks of a new generation that lack it (in-process recovery,
:mod:`trainguard.rejoin`): the replacements of lost ranks, the newcomers of a group that grows back,
and survivors one step behind. Both sides call it at the same point of a meeting (a collective,
:func:`~trainguard.rejoin.regroup.transfer_state`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from .. import console
from ..events import EventLog
from ..rejoin import regroup
from ..rejoin.gapdraws import GapDraws
from ..rejoin.protocol import Generation
from ..rejoin.rank import LOCAL_PARTS
from ..state.reshard import resharded_rank_state
from ..state.trainstate import TrainState
from .keeper import CONFIRMED, Keeper, catch_up
from .place import Place


class StateTransfer:
    """One rank's side of the state's move in a meeting.

    Args:
        model, optimizer: what is sent from the source rank (the optimizer may be ``None``).
        train_state: the Guard's named ``Stateful`` parts (the shared ones are sent; a newcomer
            derives its own from the source's).
        events: the event log (the source writes ``state_transferred``).
        keeper: this rank's keeper of its own state at a step boundary (whether the state moved after
            the step's last gradient bucket: a replacement that starts from before the move says so).
        layout: ``() -> bucket layout``: DDP's buckets as trainguard's hook last saw them (a
            replacement takes the survivors', so that its sums round as theirs do), ``None``: none.
        gap: the random numbers drawn before a step's first forward (:mod:`~trainguard.rejoin.gapdraws`):
            the survivors send a replacement their interrupted attempt's generators; ``None``:
            nothing sent.

    Attributes:
        survivors_step_seconds: on a replacement, the survivors' step time (seconds) the last move
            brought (0.0 before).
        survivors_layout: the DDP bucket layout the last move brought (``None`` before or without).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        train_state: TrainState,
        events: EventLog,
        keeper: Keeper,
        layout: Callable[[], Optional[list[list[int]]]],
        gap: Optional[GapDraws] = None,
    ):
        self.model, self.optimizer, self.train_state = model, optimizer, train_state
        self.events, self.keeper, self.layout, self.gap = events, keeper, layout, gap
        self.survivors_step_seconds = 0.0
        self.survivors_layout: Optional[list[list[int]]] = None

    def move(
        self,
        gen: Generation,
        place: Place,
        step: int,
        kept: Optional[dict[int, dict]],
        src: Optional[int] = None,
        current: Optional[dict[str, Any]] = None,
    ) -> Place:
        """Move the model, optimizer and shared state from rank ``src`` (default: the lowest
        surviving rank) to the replacements of ``gen`` (``kept``: a replacement's boundaries,
        ``None`` on a survivor) and to survivors one step behind (``current``: their own state at
        ``step``). A newcomer (``gen.grown``) takes that rank's own state too, with the data
        position and RNG streams derived for its rank as on a resume on another world size
        (:func:`~trainguard.state.reshard.resharded_rank_state`). Returns the place after it."""
        joining = kept is not None
        src = min(set(range(gen.world_size)) - set(gen.replaced)) if src is None else src
        t0 = time.perf_counter()
        parts = [n for n in self.train_state.parts if gen.grown or n not in LOCAL_PARTS]
        shared = {
            "layout": self.layout(),
            "step_seconds": place.step_seconds,
            "hosts": list(place.hosts),
            "next_check": step + 1,
            "next_report": place.next_report,
            "state": self.train_state.state_dict(parts) if place.rank == src else None,
            "moved_after_bucket": self.keeper.move_after_bucket(step),
            "attempt_rng": self.gap.attempt() if self.gap is not None and not joining else None,
        }
        packet, moved = regroup.transfer_state(self.model, self.optimizer, src, shared)
        self.survivors_step_seconds = float(packet.get("step_seconds") or 0.0)
        self.survivors_layout = packet["layout"]
        if joining:
            if packet["layout"]:  # the survivors' buckets, so that the sums round as theirs do
                regroup.rebind_ddp(self.model, packet["layout"])
            if place.rank in gen.grown:
                own = resharded_rank_state({**packet["state"], "step": step}, place.rank)
            else:
                own = kept[step]
                if packet["moved_after_bucket"] and not own.get(CONFIRMED, True):
                    caught = catch_up(own, packet["moved_after_bucket"])
                    if caught is None:
                        self._say_unconfirmed(place.rank, step)
                    own = caught or own
            self.train_state.load_state_dict({**packet["state"], **own})
            if self.gap is not None and place.rank not in gen.grown:  # a replacement of a lost rank
                self.gap.joined(packet.get("attempt_rng"))
            place = replace(place, step=step)
        elif current is not None:
            self.train_state.load_state_dict({**packet["state"], **current})
            place = replace(place, step=step)
        if place.rank == src:
            self.events.emit(
                "state_transferred",
                place.step,
                rank=src,
                to_ranks=list(gen.replaced),
                bytes=moved,
                seconds=round(time.perf_counter() - t0, 4),
            )
        return replace(
            place, hosts=tuple(packet["hosts"]), next_check=packet["next_check"], next_report=packet["next_report"]
        )

    def _say_unconfirmed(self, rank: int, step: int) -> None:
        """A replacement took a boundary kept before the step's last gradient bucket, and the
        survivors' own state moved after that bucket in a way it cannot follow (see
        :mod:`.keeper`): say the resume is not bitwise (``resume_not_bitwise``, a console line)."""
        cause = (
            f"rank {rank} was lost after step {step}'s last gradient bucket and before the step's end, where the loop "
            "moved its own state (random numbers drawn by an evaluation's DataLoader, a batch taken after the "
            "backward): its replacement starts from the state before that move"
        )
        self.events.emit("resume_not_bitwise", step, rank=rank, cause=cause)
        console.warn(f"a resume cannot be bitwise identical: {cause}")
