"""The Guard's edge: an outcome raised inside one of its public methods is carried out once (one
console line, the ``exit`` event, leaving alone or together), then propagates.

A component of :class:`~trainguard.guard.Guard` (see "Outcomes" in its module doc): :class:`Edge`
decides once per process, :func:`announce` says what happened; the Guard releases what it
installed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

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

    def __call__(self) -> Edge:
        """``with edge():``: this object itself (it holds no state per entry, so entries may nest;
        a class's ``__enter__``/``__exit__`` cost a fifth of a ``contextlib`` generator's, and the
        Guard enters it a few times per step)."""
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], tb: Any) -> bool:
        if isinstance(error, Outcome) and not self.left:
            self.left = True
            self._leave(error)
        return False  # the outcome (or any other error) propagates


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
