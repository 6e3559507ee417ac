"""Keeping this rank's own state at a step boundary (:mod:`trainguard.rejoin.boundary`), for a
replacement of a lost rank to start from: the parts a rank holds alone (data position, extras,
random number generators: :data:`~trainguard.rejoin.rank.LOCAL_PARTS`)."""

from __future__ import annotations

from ..rejoin.rank import LOCAL_PARTS, Rejoin
from ..state.trainstate import TrainState


class Keeper:
    """Keeps this rank's own state as the boundary of a step.

    Args:
        rejoin: this rank's recovery state (``keeping``, ``failure``, ``keep``).
        train_state: the parts to keep (those of :data:`~trainguard.rejoin.rank.LOCAL_PARTS` it has).
    """

    def __init__(self, rejoin: Rejoin, train_state: TrainState):
        self.rejoin, self.train_state = rejoin, train_state

    def keep(self, step: int) -> None:
        """Keep this rank's own state as the boundary of step ``step``."""
        self.rejoin.keep({"step": step, **self.train_state.state_dict(LOCAL_PARTS)})

    def before_last_bucket(self, step: int) -> None:
        """DDP's hook or ``guard.run_step`` is about to send step ``step``'s last gradient bucket:
        keep this rank's own state as its boundary, since after the send a peer may complete the
        step (``should_step`` runs no collective when the detectors' values ride in that bucket).
        Kept again when the bucket is sent again (``run_step``'s retry after out-of-memory)."""
        if self.rejoin.keeping and self.rejoin.failure is None:
            self.keep(step)
