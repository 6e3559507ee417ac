"""Preemption signals: the handler only records the signal; the Guard acts at the step boundary.

On the first stop signal a hard-deadline timer starts: if the process has not exited
``save_deadline`` seconds later (for example the emergency save hangs on a dead filesystem), the
timer thread calls ``on_deadline`` and exits the process with the requeue code. Because a
checkpoint becomes visible only by its final atomic rename, the previous checkpoint stays valid.

:class:`HardDeadline` is the one place in trainguard that ends the process from another thread:
when the main thread is stuck (in a save on a dead filesystem, in a collective whose peer is gone),
no exception can reach it. Its other user is the liveness ping (:mod:`trainguard.health.ping`),
whose failure means the main thread is waiting in a collective that will not complete.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Optional

from ..exitcodes import ExitCode


class HardDeadline:
    """A watchdog thread that ends the process ``seconds`` after :meth:`arm` unless cancelled.

    Args:
        name: the thread's name (``trainguard-deadline``...).
    """

    def __init__(self, name: str = "trainguard-deadline"):
        self.name = name
        self._thread: Optional[threading.Thread] = None
        self._cancelled = threading.Event()

    @property
    def armed(self) -> bool:
        """True once :meth:`arm` was called (and not cancelled)."""
        return self._thread is not None and not self._cancelled.is_set()

    def arm(self, seconds: float, code: int, on_expire: Optional[Callable[[], None]] = None) -> None:
        """Start the timer (once; later calls are ignored): after ``seconds``, call ``on_expire``
        (from the timer thread) and end the process with ``code`` at once (no cleanup runs)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._expire, args=(seconds, code, on_expire), daemon=True, name=self.name
        )
        self._thread.start()

    def cancel(self) -> None:
        """Stop the timer if it has not fired (the process carries on)."""
        self._cancelled.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _expire(self, seconds: float, code: int, on_expire: Optional[Callable[[], None]]) -> None:
        if self._cancelled.wait(seconds):
            return
        try:
            if on_expire:
                on_expire()
        finally:
            os._exit(code)


class ShutdownHandler:
    """Records stop signals (SIGTERM, SIGUSR1, SIGINT by default) and enforces a hard deadline.

    Args:
        signals: signal names to handle.
        deadline: seconds from the first signal until the process exits regardless.
        on_deadline: called (from the timer thread) just before the forced exit.
    """

    def __init__(self, signals: list[str], deadline: float, on_deadline: Optional[Callable[[], None]] = None):
        self.signals = [getattr(signal, name) for name in signals]
        self.deadline = deadline
        self.on_deadline = on_deadline
        self.received: Optional[str] = None
        self.received_at: Optional[float] = None
        self.deadline_timer = HardDeadline()
        self._previous: dict[int, object] = {}

    def install(self) -> ShutdownHandler:
        """Install the handlers (main thread only); returns self."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def take_back(self) -> None:
        """Install the handlers again over those a framework put in place after :meth:`install`
        (Lightning registers its own at the start of ``fit``); :meth:`uninstall` still restores
        the handlers found by the first :meth:`install`. Main thread only."""
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Restore the previous handlers."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            self.received_at = time.time()
            self.arm_deadline(self.deadline)

    def arm_deadline(self, seconds: float) -> None:
        """Start the hard-deadline timer (once): exit with the requeue code after ``seconds``."""
        self.deadline_timer.arm(seconds, int(ExitCode.REQUEUE), self.on_deadline)

    def close(self) -> None:
        """Restore the previous handlers and cancel the deadline (safe to call twice)."""
        self.uninstall()
        self.deadline_timer.cancel()
