"""Where in-process recovery's stores live: files in the launcher's private directory on one node,
TCP across nodes (issue 54 item 2).

The address of the recovery store (``TRAINGUARD_RECOVERY_STORE``, :mod:`.protocol`) is either

* ``file://PATH``: one node. The store is a ``torch.distributed.FileStore`` at ``PATH``, in a
  directory of the launcher's (``/dev/shm/trainguard-stores-<pid>-XXXX``, mode 0700): only its
  user (and root) can open it, where a ``TCPStore`` on loopback takes any local user's
  connections. Each generation's process groups meet on a file of their own beside it
  (:func:`group_store_path`: nothing of an earlier generation's keys is met, pytorch issue 135712);
* ``HOST:PORT``: several nodes; a ``TCPStore`` the launcher serves (:func:`~.protocol.serve`),
  its values sealed (:mod:`.auth`).

What torch's ``FileStore`` does that matters here (torch 2.13, measured in
``tests/test_private_stores.py``): every operation the protocol uses works (``set``, ``get``,
``check``, ``add``, ``compare_set``, ``wait``, ``delete_key``, ``num_keys``, ``multi_get``,
``multi_set``); a read (``compare_set`` of a probe, :func:`~.auth.read_now`) does not grow the
file, each ``set`` and ``add`` appends to it (it is never compacted: a launch's stores hold kB);
``wait`` and a waiting ``get`` look every 10 ms and time out at whole seconds (a 0.3 s timeout
ends after 1 s); its constructor waits up to 300 s for a directory that does not exist
(:func:`file_store` checks first); with ``numWorkers=-1`` (as here) torch never removes the file,
with a count it is removed when that many clients have closed it. The launcher removes the
directory at its end, and a later launch removes those of launchers no longer running
(:func:`trainguard.launcher.node_private.remove_orphans`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

FILE_SCHEME = "file://"
RECOVERY_FILE = "recovery"  # the recovery store's file in the launcher's store directory


def file_address(path: Path) -> str:
    """The address of the store in file ``path`` (absolute), ``file://PATH``."""
    return FILE_SCHEME + str(Path(path).resolve())


def file_path(address: str) -> Optional[Path]:
    """The file of a ``file://PATH`` address; ``None`` for any other (``HOST:PORT``).

    Raises:
        ValueError: ``file://`` with a path that is not absolute.
    """
    if not address.startswith(FILE_SCHEME):
        return None
    path = Path(address[len(FILE_SCHEME) :])
    if not path.is_absolute():
        raise ValueError(f"expected file:///ABSOLUTE/PATH for a store, got {address!r}")
    return path


def file_store(path: Path, timeout: float) -> dist.FileStore:
    """A client of the ``FileStore`` in file ``path`` (made when absent), its operations bounded
    by ``timeout`` seconds (torch rounds up to whole seconds). Never removed by torch
    (``numWorkers=-1``).

    Raises:
        FileNotFoundError: ``path``'s directory does not exist (the launch ended): torch's
            constructor would wait 300 s for it.
    """
    if not Path(path).parent.is_dir():
        raise FileNotFoundError(f"the store directory {Path(path).parent} does not exist (its launch ended)")
    store = dist.FileStore(str(path), -1)
    store.set_timeout(timedelta(seconds=timeout))
    return store


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``.

    Raises:
        ValueError: not of that form (the message quotes it).
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT for the recovery store, got {text!r}")
    return host, int(port)


def connect(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    """A client of the TCPStore at ``host:port``."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout))


def open_store(address: str, timeout: float = 30.0) -> dist.Store:
    """A client of the recovery store at ``address`` (``file://PATH`` or ``HOST:PORT``), its
    operations bounded by ``timeout`` seconds.

    Raises:
        ValueError: ``address`` is neither form.
        FileNotFoundError: a file store whose directory is gone (:func:`file_store`).
        torch.distributed.DistError: no TCPStore answers at ``HOST:PORT`` within ``timeout``.
    """
    path = file_path(address)
    if path is not None:
        return file_store(path, timeout)
    return connect(*parse_address(address), timeout)


def group_store_path(recovery_address: Optional[str], attempt: int, number: int) -> Optional[Path]:
    """The file of the store on which generation ``number`` of group start ``attempt`` forms its
    process groups, beside the recovery store's file; ``None`` when the recovery store is not a
    file (several nodes: the generation's ``TCPStore``, :attr:`~.protocol.Generation.port`).
    The launcher, the survivors and the replacements all name it so."""
    recovery = file_path(recovery_address) if recovery_address else None
    return None if recovery is None else recovery.with_name(f"group-{attempt}-{number}")


def init_on_file(path: Path, timeout: float, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The arguments of an ``init_process_group(*args, **kwargs)`` call (a script's, or
    :func:`~.regroup.rebuild_default_group`'s) changed to form the group on the ``FileStore`` in
    ``path``: ``store=`` given, the ``init_method`` (``env://``: a ``TCPStore`` client of
    ``MASTER_ADDR:MASTER_PORT``) dropped, ``rank`` and ``world_size`` from the call or else the
    environment (``RANK``, ``WORLD_SIZE``), as ``env://`` takes them. ``timeout``: seconds, the
    store's bound (the call's own ``timeout`` when it gives one).

    Raises:
        KeyError: ``RANK`` or ``WORLD_SIZE`` is needed and not in the environment.
        FileNotFoundError: the store's directory is gone (:func:`file_store`).
    """
    kwargs = dict(kwargs)
    args = args[:1]  # the backend; a positional init_method is dropped
    kwargs.pop("init_method", None)
    given = kwargs.get("timeout")
    seconds = given.total_seconds() if isinstance(given, timedelta) else timeout
    kwargs["store"] = file_store(path, seconds)
    if kwargs.get("rank", -1) in (-1, None):
        kwargs["rank"] = int(os.environ["RANK"])
    if kwargs.get("world_size", -1) in (-1, None):
        kwargs["world_size"] = int(os.environ["WORLD_SIZE"])
    return args, kwargs
