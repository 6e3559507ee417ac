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


def exclude_hosts(run_dir: Path, hosts: list[str]) -> Path:
    """Append ``hosts`` to ``RUN_DIR/exclude_nodes`` (one per line, each once), the hosts a requeue
    leaves out (:mod:`trainguard.slurm.requeue`). Returns the file's path.

    Raises:
        OSError: the file cannot be read or written.
    """
    path = run_dir / "exclude_nodes"
    known = set(path.read_text().split()) if path.exists() else set()
    new = sorted(set(hosts) - known)
    with open(path, "a") as f:
        f.writelines(h + "\n" for h in new)
    return path
