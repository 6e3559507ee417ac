"""Preemption signals: the handler only records the signal; the Guard acts at the step boundary.

On the first stop signal a hard-deadline timer starts: if the process has not exited
``save_deadline`` seconds later (for example the emergency save hangs on a dead filesystem), the
timer thread calls ``on_deadline`` and exits the process with the requeue code. Because a
checkpoint becomes visible only by its final atomic rename, the previous checkpoint stays valid.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Optional

from .exitcodes import ExitCode


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
        self._timer: Optional[threading.Thread] = None
        self._previous: dict[int, object] = {}

    def install(self) -> "ShutdownHandler":
        """Install the handlers (main thread only); returns self."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

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
        if self._timer is not None:
            return
        self._timer = threading.Thread(target=self._expire, args=(seconds,), daemon=True, name="trainguard-deadline")
        self._timer.start()

    def _expire(self, seconds: float) -> None:
        time.sleep(seconds)
        try:
            if self.on_deadline:
                self.on_deadline()
        finally:
            os._exit(int(ExitCode.REQUEUE))
