"""The run directory: created and checked for writing before anything is written into it.

Imports no torch (the launcher and the rank use it alike).
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import ConfigError


def prepare_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (mode 0700: it holds the launch's secret and the ranks' logs; a directory
    that exists keeps its mode) and check that it is writable (a probe file is written and removed).

    Raises:
        ConfigError: it cannot be created or written (names the directory and the OS error).
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run dir {run_dir} is not writable: {e.strerror or e}") from None
