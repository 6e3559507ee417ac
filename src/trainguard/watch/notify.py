"""Notifications through apprise URLs (e-mail, JSON webhooks, Slack, ... one URL per channel).

Every URL is checked with apprise when the watch starts, so a typo fails before any check runs.
Each URL is sent to on its own, so a failure names the channel and never stops the others.
Forms known to work against local servers:

* ``mailto://HOST:PORT?from=watch@example.com&to=ops@example.com``: plain SMTP, no TLS, no login
  (``mailto://`` defaults to ``mode=insecure``; ``mailtos://`` uses STARTTLS; add ``user:pass@``
  before the host to log in).
* ``json://HOST:PORT/PATH``: POSTs ``{"version", "title", "message", "attachments", "type"}``;
  ``type`` is ``failure`` for an alert and ``success`` for a recovery.

apprise is the optional extra ``trainguard[watch]``, imported only when there is a URL to notify:
a watch without URLs runs without it, one with URLs and no apprise is bad input (exit code 2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from .errors import WatchError

_PASSWORD = re.compile(r"(://[^:/@?#]*:)[^@/?#]*@")


def _apprise() -> Any:
    """The apprise module, imported on first use.

    Raises:
        WatchError: apprise is not installed (it comes with the ``trainguard[watch]`` extra).
    """
    try:
        import apprise
    except ImportError as e:
        raise WatchError(
            f"notifications need apprise, which is not installed ({e}); "
            "install it with: pip install 'trainguard[watch]'"
        ) from None
    return apprise


def redact(url: str) -> str:
    """The URL with a ``user:password@`` password replaced by ``***``."""
    return _PASSWORD.sub(r"\1***@", url)


@dataclass
class Failure:
    """A notification that did not go out: the URL (as given), a printable form, and why."""

    url: str
    shown: str
    reason: str


class Notifier:
    """The validated notification URLs.

    Raises:
        WatchError: a URL apprise cannot parse (``invalid notification URL ...``), or URLs given
            and apprise not installed.
    """

    def __init__(self, urls: list[str]):
        self.plugins: dict[str, Any] = {}
        apprise = _apprise() if urls else None
        for url in urls:
            plugin = apprise.Apprise.instantiate(url)
            if plugin is None:
                raise WatchError(f"invalid notification URL {redact(url)!r}: apprise does not recognise it")
            self.plugins[url] = plugin

    @property
    def urls(self) -> list[str]:
        return list(self.plugins)

    def shown(self, url: str) -> str:
        """The URL as apprise prints it with secrets hidden."""
        try:
            return self.plugins[url].url(privacy=True)
        except Exception:
            return redact(url)

    def send(self, title: str, body: str, ok: bool, urls: Optional[list[str]] = None) -> list[Failure]:
        """Send to every URL (or those in ``urls``); return the failures, never raise.

        ``ok`` picks the notification type: ``success`` (a recovery) or ``failure`` (an alert).
        """
        if not self.plugins:
            return []
        apprise = _apprise()
        kind = apprise.NotifyType.SUCCESS if ok else apprise.NotifyType.FAILURE
        failures = []
        for url in self.plugins if urls is None else [u for u in urls if u in self.plugins]:
            channel = apprise.Apprise()
            channel.add(self.plugins[url])
            try:
                result = channel.notify(body=body, title=title, notify_type=kind)
            except Exception as e:  # a plugin bug must not stop the watch
                failures.append(Failure(url, self.shown(url), f"{type(e).__name__}: {e}"))
                continue
            if not result:
                failures.append(Failure(url, self.shown(url), _reason(result)))
        return failures


def _reason(result: Any) -> str:
    """The warnings apprise recorded for a failed send (apprise ≥ 2 keeps them on the result)."""
    try:
        messages = [e.message for e in result.logs() if e.level in ("WARNING", "ERROR", "CRITICAL")]
    except Exception:
        messages = []
    return "; ".join(dict.fromkeys(messages)) or "apprise reported a failure"
