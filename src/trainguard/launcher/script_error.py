"""A script error is not restarted: ranks that fail before their first step with an ordinary exception.

A restart cures a lost process, a hung collective, a bad node; it does not cure a typo, a bad
argument or a missing import, which fail again the same way, seconds later, every time. So when
the ranks of a launch's first worker group fail before any of them completed a step, the launcher
reads the tail of each failed rank's stderr (torch elastic tees it to ``RUN_DIR/logs``) and, if it
ends in a Python traceback that is not a connection or rendezvous failure (those are retried: a
peer node or the store may come up late), ends the launch at once with the rank's exit code and
the traceback's last lines instead of spending the restart budget.

:func:`decide` is the whole decision, from plain values (tested in one process).
"""

from __future__ import annotations

import os
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
)


@dataclass(frozen=True)
class ScriptError:
    """A failure before the first step that a restart would not cure.

    Attributes:
        rank: global rank whose traceback is shown.
        exit_code: its exit code (the launch ends with it).
        lines: the last lines of its traceback (at most :data:`SHOWN_LINES`).
    """

    rank: int
    exit_code: int
    lines: tuple[str, ...]

    @property
    def reason(self) -> str:
        """One line for ``launch_exit`` and the console: the exception line of the traceback."""
        return f"the script failed before its first step (rank {self.rank}): {self.lines[-1]}; not restarted"


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
    (at most :data:`SHOWN_LINES` lines, the exception line last); ``None`` if there is none."""
    lines = [line.rstrip() for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    body = [line for line in lines[starts[-1] :] if line.strip()]
    last = max((i for i, line in enumerate(body) if not line.startswith(" ") and i > 0), default=None)
    if last is None:
        return None
    return tuple(body[: last + 1][-SHOWN_LINES:])


def decide(
    first_group: bool, codes: dict[int, int], steps_done: dict[int, Optional[int]], stderr: dict[int, str]
) -> Optional[ScriptError]:
    """Whether a failed worker group is a script error that must not be restarted.

    Args:
        first_group: the failure is in the launch's first worker group (no restart yet).
        codes: ``{global rank: exit code}`` of the failed ranks (negative: killed by that signal).
        steps_done: ``{global rank: steps completed by its process}`` for every rank of the node
            (``None``: no heartbeat record, it never reached the Guard).
        stderr: ``{global rank: the tail of its stderr}`` of the failed ranks.
    Returns:
        The error to end the launch with, or ``None`` (restart as usual): not the first group, a
        rank that completed a step, no rank that exited with a code > 0 (ranks killed by a signal
        are not looked at), one of those without a traceback, or a traceback whose
        exception is a connection/rendezvous failure (:data:`TRANSIENT`).
    """
    errors = {rank: code for rank, code in codes.items() if code > 0}  # the others: killed by a signal (the
    if not first_group or not errors or any((n or 0) > 0 for n in steps_done.values()):  # launcher's, often)
        return None
    for rank in sorted(errors):
        tail = traceback_tail(stderr.get(rank, ""))
        if tail is None or any(marker in tail[-1] for marker in TRANSIENT):
            return None
    rank = min(errors)
    return ScriptError(rank, errors[rank], traceback_tail(stderr[rank]) or ())
