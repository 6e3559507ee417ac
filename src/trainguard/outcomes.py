"""Outcomes: how a run ends when it does not simply finish, as exceptions that carry their exit code.

Components never end the process. They raise one of these (or return a decision that the Guard
turns into one); the edge — the :class:`~trainguard.guard.Guard`'s public methods and the CLI —
writes the ``exit`` event, releases what the Guard installed and lets the exception propagate.
Because :class:`Outcome` is a :class:`SystemExit`, a script that does not catch it still exits
with the right code (75 requeue, 76 give up, 2 bad input), and a notebook or a test can catch it::

    try:
        for step in guard.steps(100):
            ...
    except trainguard.Requeue as stop:
        print(stop.reason, stop.exit_code)  # e.g. "signal", 75

The one place allowed to end the process from another thread is the preemption hard deadline
(:mod:`trainguard.stop.signals`): when the main thread is stuck (say, in a save on a dead filesystem),
no exception can reach it.

This module imports nothing heavy (no torch): the CLI and the launcher use it too.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn, Optional

from .exitcodes import ExitCode


class Outcome(SystemExit):
    """Base of every outcome: ``exit_code`` (an :class:`~trainguard.exitcodes.ExitCode`), ``reason``
    (a short machine-readable word such as ``"signal"``), ``message`` (one line for a human) and
    ``details`` (extra fields for the ``exit`` event).

    ``collective`` is True when every rank raises the same outcome at the same step (a decision the
    ranks agreed on), so the Guard may leave together (a barrier) before the process ends.
    """

    exit_code: ExitCode = ExitCode.GIVE_UP
    collective: bool = True

    def __init__(self, reason: str, message: str = "", **details: Any):
        super().__init__(int(self.exit_code))
        self.reason, self.message, self.details = reason, message or reason, details

    def __str__(self) -> str:
        return self.message


class Requeue(Outcome):
    """Stopped cleanly at a step boundary after a save: relaunch to resume (exit code 75).

    Reasons: ``signal``, ``kill_switch``, ``time_limit``, ``memory``, ``straggler``.
    """

    exit_code = ExitCode.REQUEUE


class GiveUp(Outcome):
    """Recovery is past its budget or impossible; a relaunch would fail the same way (exit code 76).

    Reasons: ``instability``, ``out_of_memory``, ``checkpoint_failures``, ``sdc``.
    """

    exit_code = ExitCode.GIVE_UP


class Withdraw(Outcome):
    """This rank leaves the group and the others carry on (exit code 77): its hardware computed
    wrong numbers again (a persistent silent data corruption, ``[sdc] on_persistent = "replace"``).
    Raised on the withdrawn ranks only (``collective`` is False); under in-process recovery the
    launcher gives the rank to a warm spare, which takes the state from the others.
    """

    exit_code = ExitCode.WITHDRAWN
    collective = False


class BadInput(Outcome):
    """Input a human must fix: config, arguments, run dir, a checkpoint of another model (exit code 2).

    Raised on the rank that found it (``collective`` is False: its peers may not know).
    """

    exit_code = ExitCode.BAD_INPUT
    collective = False

    def __init__(self, message: str, **details: Any):
        super().__init__("bad_input", message, **details)


def exit_bad_input(message: str, events: Optional[Any] = None) -> NoReturn:
    """For a script's own edge (its ``main``): print ``trainguard: error: message`` to stderr,
    record a ``bad_input`` event in ``events`` (an :class:`~trainguard.events.EventLog`, if given),
    and raise :class:`BadInput` (exit code 2 when uncaught)."""
    print(f"trainguard: error: {message}", file=sys.stderr, flush=True)
    if events is not None:
        events.emit("bad_input", message=message)
    raise BadInput(message)
