"""One live Guard per process: a second one, built before the first is closed, is refused.

A Guard installs process-wide wrappers (``torch.distributed``'s collectives, ``clip_grad_norm_``,
``Tensor.backward``, ``sys.excepthook``, signal handlers) whose callbacks are its own; two live
Guards would each wrap the other's wrappers, and the first to close would take back what the
other still uses. So the second is refused with a :class:`~trainguard.outcomes.BadInput` naming
the first, and once the first is closed (``guard.close()``, the end of ``with Guard(...)``, an
outcome that released it, or its training ended: ``steps()`` ran out) a new Guard may be built:
one after the other, as a notebook does.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from .. import console
from ..outcomes import BadInput

_live: Optional[weakref.ref] = None  # the Guard that holds the process's wrappers, while it is open


def claim(guard: Any) -> None:
    """Make ``guard`` this process's live Guard. An earlier Guard whose training ended
    (``steps()`` ran out, ``finish()``) but that was not closed, as the README's loop leaves it, is
    released first, with one console line (a notebook's cell run again).

    Raises:
        BadInput: another Guard of this process is training (begun, not finished, not closed).
    """
    global _live
    other = _live() if _live is not None else None
    if other is not None and other is not guard and other.finished:
        console.say(
            f"the earlier Guard of this process (run dir {other.run_dir}) finished training unclosed: closed now"
        )
        other.abandon()
        other = None
    if other is not None and other is not guard and not other.training:  # built, not begun: it trains after this one
        console.say(
            f"another Guard of this process (run dir {other.run_dir}) is open and has not begun training: "
            "both share the process-wide wrappers, so close each before the other's training begins"
        )
        other = None
    if other is not None and other is not guard:
        raise BadInput(
            f"another Guard of this process (run dir {other.run_dir}) is still open: close it first "
            "(guard.close(), or build it in `with trainguard.Guard(...) as guard:`); one Guard per process at a time"
        )
    _live = weakref.ref(guard)


def release(guard: Any) -> None:
    """``guard`` was closed (or released after a failure): a new Guard may be built."""
    global _live
    if _live is not None and _live() is guard:
        _live = None
