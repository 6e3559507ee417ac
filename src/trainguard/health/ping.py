"""Collective liveness ping (``[health] ping``): a dead or stopped peer found in seconds, not at the
process group's 10–30 minute timeout.

A background thread on every rank runs a one-element ``all_reduce`` on a process group of its own
(same backend as training, so NCCL pings NCCL) every ``ping_interval`` seconds, on a schedule all
ranks share, and waits for it at most ``ping_timeout`` seconds, polling ``Work.is_completed()``
(no backend-specific timeout needed). Because the thread does not wait for the training loop, the
ping also fires while the loop itself is blocked inside a collective for a peer that will never
arrive — the case it exists for. The interval is in seconds, not steps, for that reason: a
step-driven ping cannot run while no step completes.

Before each ping every rank sets ``trainguard/ping/<attempt>/<n>/<rank>`` in the job's store; on a
timeout the ranks without that key are the ones that never reached ping ``n``: they are named (with
their hosts) in a ``ping_timeout`` event. The ping then calls ``on_failure``: the Guard arms its
hard deadline (:class:`~trainguard.stop.signals.HardDeadline`), because the main thread is waiting in
a collective that will not complete and no exception can reach it; the process exits with code 1
and ``trainguard run`` restarts the group from the newest checkpoint. A main thread that reaches a
step boundary first raises :class:`PeerLostError` there instead. Shutdown agrees on the number of pings first
(every rank finishes the same sequence), so a clean exit never leaves a ping half-matched.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import compat
from .. import dist as tgdist
from ..events import EventLog

PING_FAILED_EXIT = 1  # a failure: the launcher restarts the group


class PeerLostError(RuntimeError):
    """A peer rank stopped answering the liveness ping (the ``ping_timeout`` event names it)."""


def _default_store() -> Optional[dist.Store]:
    return compat.default_store()


class LivenessPing:
    """Background all-reduce ping with its own timeout (create on every rank; a collective).

    Args:
        interval: seconds between pings.
        timeout: seconds a ping may take before the missing ranks are reported.
        hosts: host name of every rank (index = rank).
        events: where ``ping_timeout`` goes.
        device: where the ping tensor lives (the training device; CUDA for NCCL).
        on_failure: called from the ping thread after a ``ping_timeout`` event, with its message.

    Attributes:
        failed: the failure's message once a ping timed out, else ``None``.
    """

    def __init__(
        self,
        interval: float,
        timeout: float,
        hosts: list[str],
        events: EventLog,
        device: torch.device,
        on_failure: Optional[Callable[[str], None]] = None,
    ):
        self.interval, self.timeout, self.hosts, self.events = interval, timeout, hosts, events
        self.on_failure = on_failure
        self.failed: Optional[str] = None
        self.rank, self.world = tgdist.rank(), tgdist.world_size()
        self.device = device
        self.group = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=max(timeout * 4, 60)))
        self.store = _default_store()
        self.prefix = f"trainguard/ping/{events.attempt}"
        self.launched = 0
        self.final: Optional[int] = None  # agreed number of pings at shutdown
        self.last_seconds: Optional[float] = None  # duration of the last completed ping
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, t0: float) -> None:
        """Start pinging at ``t0 + k × interval`` (``t0``: a Unix time shared by all ranks)."""
        self._t0 = t0
        self._thread = threading.Thread(target=self._run, name="trainguard-ping", daemon=True)
        self._thread.start()

    def _key(self, n: int, rank: int) -> str:
        return f"{self.prefix}/{n}/{rank}"

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        one = torch.ones(1, device=self.device)
        while self.failed is None and (n := self._next()) is not None:
            self._ping(n, one)

    def _next(self) -> Optional[int]:
        """Wait until the next ping is due and return its number; ``None`` once shutdown's agreed
        number of pings is reached."""
        while not self._stopping.is_set():
            delay = self._t0 + (self.launched + 1) * self.interval - time.time()
            if delay > 0 and self._stopping.wait(delay):
                break
            with self._lock:
                if not self._stopping.is_set():
                    self.launched += 1
                    return self.launched
        while self.final is None:  # stop() is agreeing on the count with the other ranks
            time.sleep(0.005)
        if self.launched >= self.final:
            return None
        self.launched += 1
        return self.launched

    def _ping(self, n: int, tensor: torch.Tensor) -> None:
        if self.store is not None:
            self.store.set(self._key(n, self.rank), "1")
        t0 = time.monotonic()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        while not work.is_completed():
            if time.monotonic() - t0 > self.timeout:
                return self._fail(n)
            time.sleep(0.01)
        self.last_seconds = time.monotonic() - t0
        if self.store is not None and n > 1:
            self.store.delete_key(self._key(n - 1, self.rank))

    def _missing(self, n: int) -> Optional[list[int]]:
        """Ranks that never set their key for ping ``n`` (``None`` if the store does not answer)."""
        if self.store is None:
            return None
        found: list[Optional[list[int]]] = [None]

        def look() -> None:
            found[0] = [r for r in range(self.world) if not self.store.check([self._key(n, r)])]

        t = threading.Thread(target=look, daemon=True)
        t.start()
        t.join(5.0)  # the store server may live in the very process that stopped
        return found[0]

    def _fail(self, n: int) -> None:
        missing = self._missing(n)
        self.events.emit(
            "ping_timeout",
            None,
            rank=self.rank,
            ping=n,
            timeout=self.timeout,
            missing_ranks=missing,
            missing_hosts=None if missing is None else [self.hosts[r] for r in missing],
            why="no answer from the store" if missing is None else None,
        )
        self.failed = f"liveness ping {n} got no answer in {self.timeout:g} s" + (
            f" from rank(s) {missing}" if missing else ""
        )
        if self.on_failure is not None:
            self.on_failure(self.failed)

    def stop(self) -> None:
        """Agree with every rank on the number of pings, finish them, stop the thread (a collective,
        on the training group; call on every rank before the group is destroyed)."""
        if self._thread is None:
            return
        if self.failed is not None:  # the thread has ended; the peers cannot agree on anything now
            self._stopping.set()
            self._thread.join()
            self._thread = None
            return
        with self._lock:
            self._stopping.set()
            mine = self.launched
        self.final = tgdist.all_reduce_max([mine])[0]
        self._thread.join()
        self._thread = None

    def abandon(self) -> None:
        """Stop the thread without agreeing with the peers (one of them is gone: in-process
        recovery destroys the ping's group with the default group and starts a new ping)."""
        if self._thread is None:
            return
        with self._lock:
            self._stopping.set()
            self.final = self.launched  # no more pings
        self._thread.join()
        self._thread = None
        self.group = None  # destroyed with the default group

    def close(self) -> None:
        """Destroy the ping's process group (after :meth:`stop`; safe to call twice)."""
        if self.group is not None and self._thread is None:
            tgdist.destroy_group(self.group)
            self.group = None
