"""A script error is not restarted: ranks that fail before their first step with an ordinary exception.

A restart cures a lost process, a hung collective, a bad node; it does not cure a typo, a bad
argument or a missing import, which fail again the same way, seconds later, every time. So when
the ranks of a launch's first worker group fail before any of them completed a step, the launcher
reads the tail of each failed rank's stderr (torch elastic tees it to ``RUN_DIR/logs``) and, if it
ends in a Python traceback that is not a connection or rendezvous failure (those are retried: a
peer node or the store may come up late), ends the launch at once with the rank's exit code and
the traceback's last lines instead of spending the restart budget.

The same holds after the training loop (a final evaluation, an export): a rank whose Guard
finished training (its heartbeat record is in the ``teardown`` section) and that then exits with a
traceback that is not a connection failure failed in the script; a restart would resume from the
final checkpoint, run no step and fail the same way. Its peers' failures are then consequences (a
peer waiting in a collective with it loses it) and are not looked at.

Tracebacks printed after ``init_process_group`` carry torch's ``[rank<N>]: `` prefix on each line
(torch.distributed's ``sys.excepthook``); it is removed before reading them.

:func:`decide` is the whole decision, from plain values (tested in one process).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

TAIL_BYTES = 16384  # of a rank's stderr read for the decision
SHOWN_LINES = 12  # of the traceback kept in the reason and printed
# exception names or message fragments of failures a restart can cure: the rendezvous, the store, a
# peer that is not up yet, a network hiccup (torch.distributed's and the standard library's names)
TRANSIENT = (
    "DistNetworkError",
    "DistStoreError",
    "RendezvousError",
    "ConnectionError",
    "ConnectionRefusedError",
    "ConnectionResetError",
    "TimeoutError",
    "socket.timeout",
    "NCCL",
    "Gloo",
    "gloo",
    "Connection reset",
    "Connection refused",
    "Connection closed",
    # trainguard's own, which a restart is meant to retry: a checkpoint that could not be read
    # after its retries (the resume, before the first step), a peer lost to the liveness ping
    "ReadError",
    "PeerLostError",
)
# what torch.distributed's sys.excepthook puts before each line once the default group exists
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


@dataclass(frozen=True)
class ScriptError:
    """A failure before the first step that a restart would not cure.

    Attributes:
        rank: global rank whose traceback is shown.
        exit_code: its exit code (the launch ends with it).
        lines: the last lines of its traceback (at most :data:`SHOWN_LINES`).
        after_loop: the rank had finished its training loop (else: before its first step).
    """

    rank: int
    exit_code: int
    lines: tuple[str, ...]
    after_loop: bool = False

    @property
    def reason(self) -> str:
        """One line for ``launch_exit`` and the console: the exception line of the traceback."""
        when = "after its training loop" if self.after_loop else "before its first step"
        return f"the script failed {when} (rank {self.rank}): {self.lines[-1]}; not restarted"


def read_tail(path: Optional[str | os.PathLike]) -> str:
    """The last :data:`TAIL_BYTES` of ``path`` as text (``""`` if it cannot be read)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def traceback_tail(text: str) -> Optional[tuple[str, ...]]:
    """The last Python traceback in ``text``, from its ``Traceback`` line to its exception line
    (at most :data:`SHOWN_LINES` lines, the exception line last, torch's ``[rank<N>]: `` prefixes
    removed); ``None`` if there is none."""
    lines = [RANK_PREFIX.sub("", line.rstrip()) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    body = [line for line in lines[starts[-1] :] if line.strip()]
    last = max((i for i, line in enumerate(body) if not line.startswith(" ") and i > 0), default=None)
    if last is None:
        return None
    return tuple(body[: last + 1][-SHOWN_LINES:])


def _transient(tail: tuple[str, ...]) -> bool:
    return any(marker in tail[-1] for marker in TRANSIENT)


def decide(
    first_group: bool,
    codes: dict[int, int],
    steps_done: dict[int, Optional[int]],
    stderr: dict[int, str],
    finished: frozenset[int] = frozenset(),
) -> Optional[ScriptError]:
    """Whether a failed worker group is a script error that must not be restarted.

    Args:
        first_group: the failure is in the launch's first worker group (no restart yet).
        codes: ``{global rank: exit code}`` of the failed ranks (negative: killed by that signal).
        steps_done: ``{global rank: steps completed by its process}`` for every rank of the node
            (``None``: no heartbeat record, it never reached the Guard).
        stderr: ``{global rank: the tail of its stderr}`` of the failed ranks.
        finished: global ranks whose process finished its training loop (the Guard's record is in
            the ``teardown`` section).
    Returns:
        The error to end the launch with, or ``None`` (restart as usual). After the loop: the
        lowest rank of ``finished`` that exited with a code > 0 and a traceback that is not a
        connection/rendezvous failure (:data:`TRANSIENT`); the other ranks' failures are not
        looked at. Before the first step: ``None`` unless it is the first group, no rank completed
        a step, and every rank that exited with a code > 0 (ranks killed by a signal are not looked
        at) ends its stderr with a traceback that is not a connection/rendezvous failure.
    """
    errors = {rank: code for rank, code in codes.items() if code > 0}  # the others: killed by a signal (the
    tails = {rank: traceback_tail(stderr.get(rank, "")) for rank in errors}  # launcher's, often)
    after = [r for r in sorted(errors) if r in finished and tails[r] is not None and not _transient(tails[r])]
    if after:
        return ScriptError(after[0], errors[after[0]], tails[after[0]] or (), after_loop=True)
    if not first_group or not errors or any((n or 0) > 0 for n in steps_done.values()):
        return None
    if any(tail is None or _transient(tail) for tail in tails.values()):
        return None
    rank = min(errors)
    return ScriptError(rank, errors[rank], tails[rank] or ())
