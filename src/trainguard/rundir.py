"""The run directory: created private and checked before anything is written into it.

Imports no torch (the launcher and the rank use it alike).

Trust: the run directory holds the launch's secret (``.recovery-key``), the configuration the ranks
read and the events the launcher acts on, and a checkpoint directory holds what every resume
loads (``torch.distributed.checkpoint``'s ``.metadata`` is a pickle). Both are created with mode
0700; an existing one that another user owns, or that others can write (group or world write
bit), is refused at start (:func:`check_private`: bad input, exit code 2) rather than fixed
behind the user's back: a directory others could write may already hold their files.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import ConfigError

WRITABLE_BY_OTHERS = 0o022  # the group and world write bits


def exposed(path: Path) -> str:
    """Why files in ``path`` (a directory or a file) could be another user's, or ``""``: it
    belongs to another user, or others can write it (group or world write bit). A path that does
    not exist is not exposed.

    Raises:
        OSError: it cannot be looked at for another reason than its absence.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return ""
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & WRITABLE_BY_OTHERS:
        return f"others can write it (mode {oct(st.st_mode & 0o777)})"
    return ""


def replaceable(path: Path) -> str:
    """Why another user could remove or replace ``path`` (which may not exist yet) or a directory
    above it, or ``""``: each existing directory from ``path`` up to ``/`` must belong to this
    user or root, and others may write it only where it is sticky (``/tmp``, ``/dev/shm``: mode
    1777, owned by root). A directory ``/dev/shm/x`` that another user made 0777 is refused; what
    is put in it could be swapped for theirs.

    Raises:
        OSError: a directory cannot be looked at for another reason than its absence.
    """
    me = os.geteuid()
    for p in (path, *path.parents):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if st.st_uid not in (me, 0):
            return f"{p} belongs to uid {st.st_uid}, not to this user (uid {me}) or root"
        if st.st_mode & WRITABLE_BY_OTHERS and not st.st_mode & 0o1000:
            return f"others can write {p} (mode {oct(st.st_mode & 0o7777)}, not sticky)"
    return ""


def check_private(path: Path, what: str) -> None:
    """Refuse a directory trainguard keeps trusted files in (the run directory, a checkpoint
    directory) when another user could have put files there (:func:`exposed`).

    Raises:
        ConfigError: names the directory, why, and the command that fixes it.
    """
    why = exposed(path)
    if why:
        raise ConfigError(
            f"{what} {path}: {why}; trainguard keeps its secret, its configuration and the checkpoints it "
            f"unpickles there. Use a directory of your own (chmod 700 {path}, or another path)"
        )


def prepare_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (mode 0700: it holds the launch's secret and the ranks' logs), refuse one
    that exists and is not private (:func:`check_private`), and check that it is writable (a
    probe file is written and removed).

    Raises:
        ConfigError: it is exposed, or cannot be created or written (names the directory and the
            OS error).
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_private(run_dir, "run dir")
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
