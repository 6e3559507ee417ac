"""The console: one concise ``trainguard: ...`` line on stderr for each thing that happened.

The event log (``events.jsonl``) is the full record; the console tells the story to the person
watching: the start (run directory, fresh or resumed from which checkpoint), checkpoints (at most
one line every :data:`CHECKPOINT_LINE_SECONDS`), a stop and why, a hang, a restart and why, an
in-process recovery, the exit code and what it means. Rank 0 speaks for the ranks, the launcher
for itself.

Verbosity comes from ``trainguard run --quiet`` / ``--verbose`` through the environment
(:data:`LEVEL_ENV`, so the ranks follow it): ``quiet`` prints warnings and errors only;
``normal`` (default) the story above; ``verbose`` also torch elastic's own log lines and the
traceback of a rank that lost a peer. Torch elastic's error lines for ranks that exit with a
decision code (75, 76, 2: not failures) are dropped in every mode (:func:`quiet_torch_elastic`):
trainguard's own line says what the code means.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

LEVEL_ENV = "TRAINGUARD_CONSOLE"
LEVELS = ("quiet", "normal", "verbose")
CHECKPOINT_LINE_SECONDS = 60.0  # at most one console line per this many seconds for interval checkpoints


def level() -> str:
    """The console level in force (``normal`` when unset or unknown)."""
    value = os.environ.get(LEVEL_ENV, "normal")
    return value if value in LEVELS else "normal"


def line(text: str) -> None:
    """Write ``text`` as one line to stderr, whatever the level; a stderr that cannot take it (a
    rank's log file on a full disk) is not an error of the run: the line is dropped.

    Written to ``sys.stderr`` itself, not through ``print``: training scripts in the style of
    torchvision's references (DETR, DeiT, MAE) replace ``builtins.print`` on every rank but 0
    (``setup_for_distributed``), which would drop what a replacement or a survivor of rank 1 says."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # ValueError: a closed stderr
        pass


def say(message: str) -> None:
    """Print ``trainguard: message`` on stderr, unless the level is ``quiet`` (never raises)."""
    if level() != "quiet":
        line(f"trainguard: {message}")


def warn(message: str) -> None:
    """Print ``trainguard: warning: message`` on stderr (every level; never raises)."""
    line(f"trainguard: warning: {message}")


class _ElasticNoiseFilter(logging.Filter):
    """Drops torch elastic's "failed (exitcode: N)" records for the decision codes (every level),
    and, below ``verbose``, its other per-process lines that trainguard's own line already tells:
    "failed (exitcode: N)" for a failure and "Sending process P closing signal S"."""

    def __init__(self, codes: tuple[int, ...]):
        super().__init__()
        self.codes = codes

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if "failed (exitcode" in msg:
            code = (record.args or (None,))[:1][0] if isinstance(record.args, tuple) else None
            return level() == "verbose" and not (isinstance(code, int) and code in self.codes)
        if "closing signal" in msg:
            return level() == "verbose"
        return True


def quiet_torch_elastic(decision_codes: tuple[int, ...]) -> None:
    """In the launcher: drop torch elastic's error lines for ranks that exit with ``decision_codes``
    (in every mode) and its per-process failure and "closing signal" lines (below ``verbose``:
    trainguard's own line names the ranks, their exit codes and what happens next); at ``verbose``,
    show its INFO lines too (``LOGLEVEL=INFO``, which the ranks inherit, and a stderr handler)."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_ElasticNoiseFilter(decision_codes))
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


# (is it a lost peer?, record it) of the newest quiet_peer_loss() call; the hook itself is installed once
_peer_loss: Optional[tuple[Callable[[BaseException], bool], Callable[[str, str], None]]] = None
# (trainguard's hook, the sys.excepthook it replaced) while installed
_installed: Optional[tuple[Callable, Callable]] = None


def _peer_loss_hook(previous: Callable) -> Callable:
    def hook(kind, exc, tb) -> None:
        if _peer_loss is None or not _peer_loss[0](exc):
            return previous(kind, exc, tb)
        first = (str(exc).strip().splitlines() or [kind.__name__])[0]
        _peer_loss[1](f"{kind.__name__}: {first}", "".join(traceback.format_exception(kind, exc, tb)))
        if level() == "verbose":
            return previous(kind, exc, tb)
        short = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo: "[.../pair.cc:537] Read error ...: ..."
        frames = [f for f in traceback.extract_tb(tb) if "site-packages" not in f.filename]
        where = f" in {frames[-1].name}() ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        say(
            f"this rank lost a peer{where}: {kind.__name__}: {short[:160]}; the launcher restarts the group "
            "(traceback: the peer_lost event in events.jsonl, or --verbose)"
        )

    return hook


def quiet_peer_loss(is_peer_loss: Callable[[BaseException], bool], record: Callable[[str, str], None]) -> None:
    """In a rank: an uncaught error about a lost peer (``is_peer_loss(exc)``; the rank exits with 1 as
    before and the launcher's own line tells the restart) is told in one line instead of its
    traceback, below ``verbose``; ``record(error, traceback)`` keeps the traceback (the Guard writes
    it as a ``peer_lost`` event). Other errors keep Python's (and torch's) traceback. Installed once
    per process (``sys.excepthook``); a later call replaces the two callables;
    :func:`restore_excepthook` puts the previous hook back."""
    global _peer_loss, _installed
    if _installed is None or sys.excepthook is not _installed[0]:  # not yet, or replaced since
        _installed = (_peer_loss_hook(sys.excepthook), sys.excepthook)
        sys.excepthook = _installed[0]
    _peer_loss = (is_peer_loss, record)


def restore_excepthook() -> None:
    """Undo :func:`quiet_peer_loss` (the Guard's ``close()``): ``sys.excepthook`` is again the hook
    it replaced, and every uncaught error gets its traceback. Where the script replaced
    ``sys.excepthook`` since (wrapping trainguard's), that stays, and trainguard's calls through.
    Safe to call twice."""
    global _peer_loss, _installed
    _peer_loss = None
    if _installed is not None and sys.excepthook is _installed[0]:
        sys.excepthook, _installed = _installed[1], None
