"""The Guard's edge: an outcome raised inside one of its public methods is carried out once (one
console line, the ``exit`` event, leaving alone or together), then propagates.

A component of :class:`~trainguard.guard.Guard` (see "Outcomes" in its module doc): :class:`Edge`
decides once per process, :func:`announce` says what happened; the Guard releases what it
installed.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from .. import console
from ..events import EventLog
from ..exitcodes import ExitCode
from ..outcomes import BadInput, Outcome


class Edge:
    """Carry out the first outcome raised inside ``with edge():`` by calling ``leave(outcome)``,
    then let it propagate; later outcomes only propagate (the process is leaving already).

    Args:
        leave: the Guard's way out for an outcome (release alone, or finish and leave together).
    """

    def __init__(self, leave: Callable[[Outcome], None]):
        self._leave = leave
        self.left = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        try:
            yield
        except Outcome as o:
            if not self.left:
                self.left = True
                self._leave(o)
            raise


def announce(o: Outcome, rank: int, step: int, events: Optional[EventLog]) -> None:
    """Say what outcome ``o`` means for this rank: one console line (where one is due) and its
    event: ``bad_input`` for :class:`~trainguard.outcomes.BadInput` (found on this rank only), an
    ``exit`` event of this rank for one that leaves alone (``Withdraw``), else rank 0's ``exit``
    event for the whole group (every rank raised the same outcome at the same step)."""
    if isinstance(o, BadInput):
        console.line(f"trainguard: error: {o.message}")
        if events is not None:
            events.emit("bad_input", step, message=o.message)
        return
    if not o.collective:
        console.line(f"trainguard: rank {rank} leaves the group: {o.message}")
        events.emit("exit", step, rank=rank, code=int(o.exit_code), reason=o.reason, message=o.message)
        return
    if rank == 0:
        if o.exit_code == ExitCode.GIVE_UP:
            console.line(f"trainguard: giving up: {o.message}")
        events.emit("exit", step, code=int(o.exit_code), reason=o.reason, message=o.message)
