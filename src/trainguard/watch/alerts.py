"""De-duplicated alerting: one notice when a condition starts alerting, one when it clears.

While a condition stays in alert nothing more is sent. It recovers when it is ``ok`` again or no
longer checked (an extra path was removed); a ``skipped`` condition (could not be checked) keeps
its alert, and so does every absent one while a check failed outright (its conditions are
unknown). Each alert and recovery is also an event (``watch_alert``, ``watch_recovered``); a
notification that fails is a warning on stderr and a ``watch_notify_failed`` event, and the alert
is retried on that channel at the next passes until it goes out (or the condition clears).
"""

from __future__ import annotations

import hashlib
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..events import EventLog
from .conditions import ALERT, OK, Condition, fmt_seconds
from .notify import Failure, Notifier
from .state import WatchState


def url_key(url: str) -> str:
    """Short digest naming a URL in the state file (which must not hold passwords)."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


@dataclass
class Outcome:
    """What one pass did about each condition: ``new`` alerts, ``held`` (name → seconds alerting),
    ``recovered`` (name → seconds it had been alerting), and the failed notifications."""

    new: list[str] = field(default_factory=list)
    held: dict[str, float] = field(default_factory=dict)
    recovered: dict[str, float] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)


class Alerter:
    """Compares a pass's conditions with ``state.alerting`` and sends what changed."""

    def __init__(self, run_dir: Path, notifier: Notifier):
        self.run_dir = Path(run_dir).absolute()
        self.notifier = notifier
        self.host = socket.gethostname()
        self._events: Optional[EventLog] = None

    def emit(self, kind: str, **details: Any) -> None:
        """Write an event (``rank`` null, as the launcher's); the log is opened on first use."""
        try:
            if self._events is None:
                self._events = EventLog(self.run_dir, None)
            self._events.emit(kind, **details)
        except OSError as e:  # a full disk is what the watch reports: keep notifying
            print(f"trainguard: warning: could not write the {kind} event: {e}", file=sys.stderr)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    def settle(self, conditions: list[Condition], state: WatchState, now: float) -> Outcome:
        """Send and record the alerts and recoveries of this pass; update ``state.alerting``."""
        outcome = Outcome()
        current = {c.name: c for c in conditions}
        for c in conditions:
            if c.status != ALERT:
                continue
            entry = state.alerting.get(c.name)
            if entry is None:
                self.emit("watch_alert", condition=c.name, message=c.message, values=c.values)
                failed = self._send(c.name, "alert", self._alert_text(c, 0.0), ok=False, urls=None, outcome=outcome)
                state.alerting[c.name] = {"since": now, "message": c.message, "unsent": failed}
                outcome.new.append(c.name)
                continue
            since = float(entry.get("since", now))
            outcome.held[c.name] = now - since
            unsent = [u for u in self.notifier.urls if url_key(u) in set(entry.get("unsent", []))]
            if unsent:
                entry["unsent"] = self._send(
                    c.name, "alert", self._alert_text(c, now - since), ok=False, urls=unsent, outcome=outcome
                )
        blind = any(c.values.get("check_failed") for c in conditions)
        for name in list(state.alerting):
            c = current.get(name)
            if (c is not None and c.status != OK) or (c is None and blind):
                continue
            entry = state.alerting.pop(name)
            seconds = now - float(entry.get("since", now))
            message = c.message if c is not None else "no longer checked"
            self.emit(
                "watch_recovered",
                condition=name,
                message=message,
                values=c.values if c is not None else {},
                alerting_seconds=round(seconds, 3),
            )
            title = f"[trainguard] RECOVERED {name}: run {self.run_dir.name} on {self.host}"
            body = (
                f"RECOVERED {name} after {fmt_seconds(seconds)}\n{message}\n"
                f"was: {entry.get('message', '')}\nrun dir: {self.run_dir} on {self.host}"
            )
            self._send(name, "recovered", (title, body), ok=True, urls=None, outcome=outcome)
            outcome.recovered[name] = seconds
        return outcome

    def _alert_text(self, c: Condition, held: float) -> tuple[str, str]:
        title = f"[trainguard] ALERT {c.name}: run {self.run_dir.name} on {self.host}"
        since = f" (alerting for {fmt_seconds(held)}; this notice could not be sent earlier)" if held else ""
        body = f"ALERT {c.name}{since}\n{c.message}\nrun dir: {self.run_dir} on {self.host}"
        return title, body

    def _send(self, name: str, notice: str, text: tuple[str, str], ok: bool, urls, outcome: Outcome) -> list[str]:
        """Send; report failures (stderr + event); return the digests of the URLs that failed."""
        failures = self.notifier.send(text[0], text[1], ok=ok, urls=urls)
        for f in failures:
            print(
                f"trainguard: warning: could not send the {notice} for {name} to {f.shown}: {f.reason}", file=sys.stderr
            )
            self.emit("watch_notify_failed", condition=name, notice=notice, url=f.shown, reason=f.reason)
        outcome.failures += failures
        return [url_key(f.url) for f in failures]
