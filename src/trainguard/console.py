"""The console: one concise ``trainguard: ...`` line on stderr for each thing that happened.

The event log (``events.jsonl``) is the full record; the console tells the story to the person
watching: the start (run directory, fresh or resumed from which checkpoint), checkpoints (at most
one line every :data:`CHECKPOINT_LINE_SECONDS`), a stop and why, a hang, a restart and why, an
in-process recovery, the exit code and what it means. Rank 0 speaks for the ranks, the launcher
for itself.

Verbosity comes from ``trainguard run --quiet`` / ``--verbose`` through the environment
(:data:`LEVEL_ENV`, so the ranks follow it): ``quiet`` prints warnings and errors only;
``normal`` (default) the story above; ``verbose`` also torch elastic's own log lines. Torch
elastic's error lines for ranks that exit with a decision code (75, 76, 2: not failures) are
dropped in every mode (:func:`quiet_torch_elastic`): trainguard's own line says what the code means.
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "TRAINGUARD_CONSOLE"
LEVELS = ("quiet", "normal", "verbose")
CHECKPOINT_LINE_SECONDS = 60.0  # at most one console line per this many seconds for interval checkpoints


def level() -> str:
    """The console level in force (``normal`` when unset or unknown)."""
    value = os.environ.get(LEVEL_ENV, "normal")
    return value if value in LEVELS else "normal"


def say(message: str) -> None:
    """Print ``trainguard: message`` on stderr, unless the level is ``quiet``."""
    if level() != "quiet":
        print(f"trainguard: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """Print ``trainguard: warning: message`` on stderr (every level)."""
    print(f"trainguard: warning: {message}", file=sys.stderr, flush=True)


class _DecisionExitFilter(logging.Filter):
    """Drops torch elastic's "failed (exitcode: N)" records for the decision codes."""

    def __init__(self, codes: tuple[int, ...]):
        super().__init__()
        self.codes = codes

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed (exitcode" not in str(record.msg):
            return True
        return not any(isinstance(a, int) and a in self.codes for a in (record.args or ())[:1])


def quiet_torch_elastic(decision_codes: tuple[int, ...]) -> None:
    """In the launcher: drop torch elastic's error lines for ranks that exit with ``decision_codes``
    (in every mode); at ``verbose``, show its INFO lines too (``LOGLEVEL=INFO``, which the ranks
    inherit, and a stderr handler)."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DecisionExitFilter(decision_codes))
    if level() != "verbose":
        return
    os.environ.setdefault("LOGLEVEL", "INFO")
    root = logging.getLogger("torch.distributed.elastic")
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(root.name) and isinstance(logger, logging.Logger):
            logger.setLevel(logging.INFO)
    root.setLevel(logging.INFO)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
