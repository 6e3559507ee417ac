"""The *finished* marker: ``RUN_DIR/FINISHED``, written when a launch finished the run.

A job array (``--array=1-K%1``) or a dependency chain queues more launches than the run may need.
When one of them finds the marker of the same command it exits 0 at once, without starting the
ranks. The marker holds a *signature* of the command (script, its arguments, the launcher's
``--set`` overrides and the config file's contents); a launch with another signature (say a larger
``train.max_steps``) trains as usual and replaces the marker when it finishes.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Optional

from ..atomic import write_atomic

FILENAME = "FINISHED"


def signature(script: str, script_args: list[str], overrides: list[str], config_path: Optional[str]) -> str:
    """A short hash of what the launch would train: the script's resolved path, its arguments, the
    overrides, and the config file's bytes (not its path)."""
    h = hashlib.sha256()
    for part in (str(Path(script).resolve()), *script_args, "\0", *overrides, "\0"):
        h.update(part.encode() + b"\0")
    if config_path:
        try:
            h.update(Path(config_path).read_bytes())
        except OSError:
            h.update(f"unreadable:{config_path}".encode())
    return h.hexdigest()[:16]


def read(run_dir: Path) -> Optional[dict]:
    """The marker's content, or ``None`` when there is none (or it cannot be read as JSON)."""
    try:
        data = json.loads((Path(run_dir) / FILENAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write(run_dir: Path, sig: str, state_sha256: Optional[str], **extra: object) -> Path:
    """Write the marker atomically (temp file + rename) and return its path.

    Args:
        sig: :func:`signature` of the launch that finished.
        state_sha256: the final state hash from the ranks' ``end`` event.
        extra: more JSON-ready details (job id, ...).
    """
    path = Path(run_dir) / FILENAME
    return write_atomic(
        path, json.dumps({"time": time.time(), "signature": sig, "state_sha256": state_sha256, **extra}) + "\n"
    )
