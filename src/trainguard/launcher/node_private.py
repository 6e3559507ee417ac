"""What a launch keeps out of other users' reach on its node (issue 54).

* the node-local directories of the heartbeats and the step boundaries (``/dev/shm``, 0700,
  named with the launcher's pid: those of launchers that no longer run are removed);
* the run directory given through no other user's symbolic link;
* torch's rendezvous store on one node: a ``FileStore`` in the private run directory; at a
  loopback ``--rdzv-endpoint``: a ``TCPStore`` bound to that address only;
* in-process recovery's stores on one node: ``FileStore`` files in a node-local directory of
  their own (``trainguard-stores-<pid>-*``, made by :func:`node_local_dir`;
  :mod:`trainguard.rejoin.stores`); the group start's process-group store stays a loopback
  ``TCPStore`` (:mod:`.pg_store`: the script's own ``init_process_group`` connects to it);
* the launcher's open-files limit raised to its hard limit, so that idle connections a
  co-tenant opens to its stores take many more to exhaust it.

Imports torch only where a store is made.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError


def node_local_dir(prefix: str) -> Path:
    """A fresh node-local directory, ``PREFIX<launcher pid>-XXXX``: in /dev/shm (memory) when
    possible. Those that launchers no longer running left (killed: no cleanup ran) are removed
    first (:func:`remove_orphans`)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    remove_orphans(Path(base or tempfile.gettempdir()), prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))


def remove_orphans(base: Path, prefix: str) -> None:
    """Remove the directories ``base/PREFIX<pid>-*`` of this user whose launcher (``pid``) is gone
    (issue 54: a crashed launch's heartbeat and boundary files stayed in /dev/shm). A directory
    whose pid runs (a launcher, or a process that took the number) is kept."""
    try:
        entries = list(base.glob(f"{prefix}*-*"))
    except OSError:
        return
    for d in entries:
        pid = d.name[len(prefix) :].partition("-")[0]
        try:
            if not pid.isdigit() or d.is_symlink() or d.lstat().st_uid != os.geteuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # PermissionError: the pid runs as another user
            continue


def refuse_foreign_link(path: Path) -> None:
    """Refuse a ``--run-dir`` that is, or passes through, a symbolic link another user owns: they
    could point it elsewhere between two looks (issue 54). A link of this user's (or root's) is
    followed.

    Raises:
        ConfigError: names the link and its owner.
    """
    for p in (path, *path.parents):
        try:
            if p.is_symlink() and (uid := p.lstat().st_uid) not in (os.geteuid(), 0):
                raise ConfigError(
                    f"run dir {path}: {p} is a symbolic link of uid {uid}, not of this user; give the directory itself"
                )
        except OSError:
            continue


RENDEZVOUS_FILE = ".rendezvous-store"


def private_rendezvous_file(run_dir: Path) -> Path:
    """One node: the file of torch's rendezvous store (a ``FileStore``), ``RUN_DIR/.rendezvous-store``.
    The run directory is private (0700, :func:`~trainguard.rundir.check_private`): no other user
    can open it, where a ``TCPStore`` on loopback takes any local user's connections (issue 54).
    A file left by a launch that died is removed (the run directory is locked: no launch uses it).

    Raises:
        OSError: the file cannot be removed.
    """
    path = Path(run_dir) / RENDEZVOUS_FILE
    path.unlink(missing_ok=True)
    return path


def loopback_server(endpoint: str) -> Optional[Any]:
    """One node at ``--rdzv-endpoint HOST:PORT`` with a loopback ``HOST``: the server of torch's
    rendezvous store, bound to that address only (``None`` for another host: torch's own, which
    listens on every interface). torch's c10d rendezvous creates its ``TCPStore`` server on every
    interface; this one is bound here (``master_listen_fd``) and made *multi-tenant*, so the
    ``TCPStore`` torch then opens on the same port in this process takes it over (torch keeps one
    server per port for multi-tenant stores). Keep it alive.

    Raises:
        ConfigError: ``endpoint`` is not ``HOST:PORT``, or the port cannot be bound.
    """
    import ipaddress
    from datetime import timedelta

    import torch.distributed as dist

    from ..rejoin.protocol import parse_address

    try:
        host, port = parse_address(endpoint)
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return None
    host = "127.0.0.1" if host == "localhost" else host
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ConfigError(f"--rdzv-endpoint {endpoint}: cannot listen there: {e.strerror or e}") from None
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=60),
        master_listen_fd=sock.detach(),
    )


OPEN_FILES_CAP = 1 << 20  # the open-files limit asked for where the hard limit is unlimited


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (at most
    :data:`OPEN_FILES_CAP`); the ranks inherit it. Each connection to a store the launcher serves
    takes one of its descriptors, and torch's ``TCPStore`` server caps none: at a soft limit of
    1,024, 1,500 idle connections of another user made the launcher die (``Too many open files``).
    Returns the soft limit now (unchanged where it cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CAP)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft
