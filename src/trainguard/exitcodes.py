"""The exit codes every trainguard process uses (one table, also in the README).

| code | name       | meaning                                                      |
|------|------------|--------------------------------------------------------------|
| 0    | OK         | the run finished                                             |
| 2    | BAD_INPUT  | bad config, arguments, run dir, or a checkpoint that does not fit |
| 75   | REQUEUE    | stopped cleanly and resumable (EX_TEMPFAIL from sysexits.h): preemption signal, time limit, kill switch, memory watchdog |
| 76   | GIVE_UP    | gave up: restart budget spent, a recurring fault, instability or out of memory past recovery; do not requeue |
| 77   | WITHDRAWN  | a rank only: it left the group, whose other ranks carry on (its hardware computes wrong numbers, `[sdc] on_persistent = "replace"`); the launcher gives its rank to a spare |

75 is ``EX_TEMPFAIL`` from BSD ``sysexits.h`` ("temporary failure, try again later"), the code
schedulers and wrappers commonly treat as "retry". 76 is the next free code below 128, chosen so
that it never collides with a signal death (128 + N) or Python's generic error (1); 77 is the
next one. The launcher never ends with 77: it reads a rank's 77 as that rank lost.

This module imports nothing of trainguard's (:mod:`trainguard.outcomes`, which raises them, imports it).
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes shared by the launcher and every rank."""

    OK = 0
    BAD_INPUT = 2
    REQUEUE = 75
    GIVE_UP = 76
    WITHDRAWN = 77


def describe(code: int) -> str:
    """Return a one-word description of an exit code (``'signal 9'`` for negative codes)."""
    if code < 0:
        return f"signal {-code}"
    try:
        return ExitCode(code).name.lower()
    except ValueError:
        return f"error {code}"
