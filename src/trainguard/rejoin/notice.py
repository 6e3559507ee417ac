"""A rank hears that a node was lost, so that it does not wait on a host that stopped answering.

A peer that dies closes its connections and its peers' collective fails within milliseconds
(:mod:`.catch`). A host that stops answering (a NIC gone, a kernel hung, a network partition)
closes nothing: its peers would wait in their collective with it until gloo's timeout. The
leading node's launcher finds such a node by its silent beat (:mod:`trainguard.launcher.nodes`)
and, before it publishes the generation that replaces the node's ranks, says so in the recovery
store (:meth:`~.protocol.RecoveryStore.node_lost`). A thread of each rank waits for that word on
a connection of its own (a look every 0.1 s) and cuts the group's connections (:func:`.sever.cut`): the collective
ends on this rank at once and it recovers as from any lost peer. A rank that already caught the
loss (a killed node) cuts nothing.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch.distributed as dist

from . import sever
from .auth import Seal
from .protocol import RecoveryStore
from .stores import open_store

TIMEOUT = 2.0  # seconds a store call may take: the thread must be out of it soon after stop() (see there)
LOOK = 0.1  # seconds between looks (a look, not a blocking wait: c10d logs a warning at each wait's timeout)


class LostNodeNotice:
    """The watcher thread of one rank (:meth:`stop`, or the main thread's end, ends it within
    :data:`LOOK` + :data:`TIMEOUT` s; one store round trip per look).

    Args:
        address: the recovery store's ``HOST:PORT``.
        attempt: the group start's number (its keys' prefix).
        seal: the launch's secret.
        generation: the number of the generation this rank is in, read at each look.
        failed: whether this rank caught a lost peer in the current step (nothing to cut then).
        ports: the ports the group's ranks listen on (:attr:`~.rank.Rejoin.group_ports`).
        on_forged: told the key of a value that did not verify (a ``security`` event).
    """

    def __init__(
        self,
        address: str,
        attempt: int,
        seal: Seal,
        generation: Callable[[], int],
        failed: Callable[[], bool],
        ports: Callable[[], set[int]],
        on_forged: Callable[[str], None] = lambda key: None,
    ):
        self.address, self.attempt, self.seal, self.on_forged = address, attempt, seal, on_forged
        self._generation, self._failed, self._ports = generation, failed, ports
        self.cuts = 0  # times the notice cut this rank's connections
        self._stop = threading.Event()
        # not a daemon: the interpreter waits for it at exit (it ends within LOOK + TIMEOUT once the
        # main thread has); a daemon thread caught inside a store call at exit aborts the process
        self._thread = threading.Thread(target=self._run, name="trainguard-lost-node", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        store = None
        while not self._stop.is_set() and threading.main_thread().is_alive():
            try:
                if store is None:
                    store = RecoveryStore(open_store(self.address, TIMEOUT), self.attempt, self.seal, self.on_forged)
                self._look(store)
            except (RuntimeError, dist.DistError, OSError):  # the store is slow or gone (the launch ends)
                store = None
                self._stop.wait(LOOK)

    def _look(self, store: RecoveryStore) -> None:
        """One look for the word on the next generation; cut if it came and this rank has not caught
        the loss itself, then wait until this rank is in that generation."""
        number = self._generation() + 1
        if not store.was_node_lost(number):
            self._stop.wait(LOOK)
            return
        if self._generation() + 1 == number and not self._failed():
            self.cuts += 1
            sever.cut(self._ports())
        while self._generation() < number and not self._stop.wait(0.05) and threading.main_thread().is_alive():
            pass  # until this rank is in that generation (or stopped)

    def stop(self) -> None:
        """End the thread and wait for it (at most one look and a store round trip): a thread left
        inside a store call while the interpreter exits aborts the process."""
        self._stop.set()
        self._thread.join(timeout=LOOK + 2 * TIMEOUT)


__all__ = ["LostNodeNotice"]
