"""Aborting a survivor's communicators when a peer is lost (``[recovery] in_process = "nccl-experimental"``).

A rank that dies inside an NCCL collective on one node (NVLink, shared memory) closes nothing its
peers would see: they wait in the collective until NCCL's timeout (10 min by default). What ends
it is aborting the communicator. The trigger is the launcher's word that ranks were lost: it
publishes the generation that replaces them in the recovery store (:mod:`.protocol`), and a
thread of each rank (:class:`CommAbort`, a look every 0.1 s, a connection of its own) then aborts
every process group of this process's old world. The collective the main thread is blocked in
returns with an error (NCCL: "NCCL communicator was aborted", a
:data:`~.protocol.PEER_FAILURE_MARKERS` marker; and any collective error raised after the abort
counts as the lost peer, :meth:`CommAbort.aborted`), which :meth:`~.rank.Rejoin.caught` records,
and the rank recovers as from any lost peer. Before it creates the new group the main thread
makes sure the old world was aborted (:meth:`CommAbort.before_regroup`: aborted, not shut down,
since shutting an NCCL communicator down waits for its peers) and drops it from torch's registry;
the new group is then created eagerly with non-blocking communicators (:func:`init_options`), so
that its NCCL communicator exists once ``init_process_group`` returns and an abort can reach it.

What runs where:

* The thread needs the GIL: torch releases it while a collective or a CUDA synchronisation waits,
  so the thread runs while the main thread is blocked there. A main thread that holds the GIL
  while it waits (a C extension's own blocking call) is not reached: the launcher's generation
  timeout ends it (``[recovery] timeout``), as before.
* Only the backends are aborted from the thread (``ProcessGroup.abort()``, NCCL's inside one
  ``ncclGroupStart``/``ncclGroupEnd`` so that aborting several communicators cannot deadlock,
  pytorch issue 119797); torch's registry of groups is left as it is, so the main thread's next
  collective fails on the aborted group (and is caught) instead of finding no group at all (on
  gloo measured; on NCCL expected, not yet run on two GPUs).
* **gloo**: ``ProcessGroup.abort()`` does not end a collective blocked on a silent peer (torch
  2.13, measured: the collective ran on to gloo's timeout), so the abort also cuts the group's TCP
  connections (:func:`.sever.cut`): the blocked collective then fails within ~10 ms. This is how
  the abort path runs without a GPU (the tests).

Every private torch name used here is reached through :mod:`trainguard.compat` (its one checked
list; :func:`trainguard.compat.missing_abort`): where one is missing, in-process recovery is
declined at start with that reason (a group restart).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import compat
from . import sever
from .auth import Seal
from .protocol import RecoveryStore
from .stores import open_store

TIMEOUT = 2.0  # seconds a store call may take: the thread must be out of it soon after stop()
LOOK = 0.1  # seconds between looks for a published generation


def why_unsupported(backend: Optional[str]) -> Optional[str]:
    """Why the abort path cannot run with this torch (a reason to decline in-process recovery), or ``None``."""
    from .backend_policy import is_nccl

    missing = compat.missing_abort(nccl=is_nccl(backend) or dist.is_nccl_available())
    if missing:
        return f"torch {torch.__version__} lacks {', '.join(missing)} (communicator abort)"
    return None


@dataclass(frozen=True)
class Aborted:
    """What one abort did: ``groups`` process groups aborted, ``cut`` gloo connections shut down,
    in ``seconds``; ``by``: ``"watcher"`` (the thread, while the main thread waited) or
    ``"recovery"`` (the main thread, which had caught the loss itself)."""

    groups: int
    cut: int
    seconds: float
    by: str


def world_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process, the newest first (the order torch aborts them in)."""
    return compat.process_groups()


def _nccl_backend(groups: list[dist.ProcessGroup]) -> Any:
    """The NCCL backend of the default group (or of the first group that has one), ``None`` without."""
    if not dist.is_nccl_available():
        return None
    # not a choice of the model's group: every group of the old world is aborted; the default
    # group's NCCL backend is looked at first because it is the one every rank has
    for pg in sorted(groups, key=lambda g: g is not dist.group.WORLD):
        try:
            backend = compat.group_backend(pg, torch.device("cuda"))
        except RuntimeError:
            continue
        if isinstance(backend, dist.ProcessGroupNCCL):
            return backend
    return None


def abort_groups(ports: set[int], by: str = "watcher") -> Aborted:
    """Abort every process group of this process (its backends; torch's registry is left) and cut
    its gloo connections (``ports``: the ports the group's ranks listen on, :mod:`.sever`).
    Safe from any thread; a group whose abort fails is skipped (it may be shutting down already).
    """
    t0 = time.perf_counter()
    groups = world_groups()
    nccl = _nccl_backend(groups)
    n = 0
    with compat.nccl_group(nccl):
        for pg in groups:
            try:
                pg.abort()
                n += 1
            except RuntimeError:
                pass
    cut = sever.cut(ports)
    return Aborted(n, cut, time.perf_counter() - t0, by)


def clear_world() -> None:
    """The main thread, after :func:`abort_groups`: drop every group from torch's registry without
    shutting them down (an NCCL shutdown waits for the lost peer), so that ``init_process_group``
    can create the new one."""
    if dist.is_available() and dist.is_initialized():
        compat.drop_process_groups()


def init_options(backend: Optional[str]) -> dict[str, Any]:
    """Keyword arguments for the new group's ``init_process_group`` on ``backend``: for NCCL, eager
    creation on this rank's device (``device_id``: the communicator exists once the call returns,
    so an abort reaches it) with non-blocking communicators (``config.blocking = 0``: an abort
    reaches one that is still being created). Nothing for other backends."""
    from .backend_policy import is_nccl

    if not is_nccl(backend) or not torch.cuda.is_available():
        return {}
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = 0
    return {"device_id": torch.device("cuda", torch.cuda.current_device()), "pg_options": options}


class CommAbort:
    """The abort watcher of one rank: a thread that aborts this process's groups once the launcher
    publishes a generation that replaces lost ranks (one store round trip per :data:`LOOK`;
    :meth:`stop`, or the main thread's end, ends it).

    Args:
        address: the recovery store's ``HOST:PORT``.
        attempt: the group start's number (its keys' prefix).
        seal: the launch's secret.
        generation: the number of the generation this rank is in, read at each look.
        ports: the ports the group's ranks listen on (:attr:`~.rank.Rejoin.group_ports`).

    Attributes:
        last: what the last abort did (:class:`Aborted`), ``None`` before one (set once the abort
            returned: the collective it ends may return first; :meth:`before_regroup` waits for it).
    """

    def __init__(
        self,
        address: str,
        attempt: int,
        seal: Seal,
        generation: Callable[[], int],
        ports: Callable[[], set[int]],
    ):
        self.address, self.attempt, self.seal = address, attempt, seal
        self._generation, self._ports = generation, ports
        self._lock = threading.Lock()  # one abort per generation, never of a group made after it
        self._done = generation()  # the newest generation whose predecessors' groups were aborted
        self.last: Optional[Aborted] = None
        self._stop = threading.Event()
        # not a daemon: a daemon thread caught inside a store call at exit aborts the process
        self._thread = threading.Thread(target=self._run, name="trainguard-comm-abort", daemon=False)
        self._thread.start()

    def aborted(self) -> bool:
        """Whether this rank's groups were aborted for a generation it has not entered yet: any
        collective error from now until it has is the lost peer."""
        return self._done > self._generation()

    def abort_for(self, number: int, by: str = "watcher") -> Optional[Aborted]:
        """Abort the groups of the generation before ``number``, once (``None``: done already)."""
        with self._lock:
            if number <= self._done:
                return None
            self._done = number  # first: the collective the abort ends already counts as the lost peer
            self.last = abort_groups(self._ports(), by)
            return self.last

    def before_regroup(self, number: int) -> None:
        """The main thread, before it creates generation ``number``'s group: the old groups aborted
        (by the thread already, or now) and dropped from torch's registry (:func:`clear_world`)."""
        self.abort_for(number, by="recovery")
        clear_world()

    def _run(self) -> None:
        store = None
        while not self._stop.is_set() and threading.main_thread().is_alive():
            try:
                if store is None:
                    store = RecoveryStore(open_store(self.address, TIMEOUT), self.attempt, self.seal)
                self._look(store)
            except (RuntimeError, dist.DistError, OSError):  # the store is slow or gone (the launch ends)
                store = None
                self._stop.wait(LOOK)

    def _look(self, store: RecoveryStore) -> None:
        """One look at the next generation: a loss (not a growth, which the ranks meet at a step
        boundary) aborts the old groups, then the thread waits until this rank is in it."""
        number = max(self._generation(), self._done) + 1
        gen = store.peek(number)
        if gen is None or gen.grown:
            self._stop.wait(LOOK)
            return
        self.abort_for(number)
        while self._generation() < number and not self._stop.wait(0.05) and threading.main_thread().is_alive():
            pass  # until this rank is in that generation (or stopped)

    def stop(self) -> None:
        """End the thread and wait for it (at most one look and a store round trip)."""
        self._stop.set()
        self._thread.join(timeout=LOOK + 2 * TIMEOUT)


__all__ = [
    "Aborted",
    "CommAbort",
    "abort_groups",
    "clear_world",
    "init_options",
    "why_unsupported",
    "world_groups",
]
