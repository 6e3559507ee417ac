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

Secrets: a URL holds the channel's credentials (a webhook's token, an SMTP password). Given with
``--notify`` or ``--set notify=...`` it is in the process list for every user of the machine, so
the watch also reads URLs from a file of its owner's only (``--notify-file``, mode 0600:
:func:`read_url_file`) and from the environment (``TRAINGUARD_NOTIFY``: :func:`urls_from_environ`).
A URL is printed and recorded only masked (:func:`redact`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from .errors import WatchError

NOTIFY_ENV = "TRAINGUARD_NOTIFY"  # notification URLs, separated by whitespace
MASK = "***"


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


def _host_is_a_host(url: str) -> bool:
    """Whether apprise reads the host part of ``url`` as a host name (``json://HOST/...``,
    ``mailto://HOST``) rather than as a credential (``slack://TOKEN_A/...``,
    ``discord://WEBHOOK_ID/...``, ``tgram://BOT_TOKEN/...``): its plugin's URL template has a
    ``host`` token. ``False`` when apprise is missing or does not know the URL."""
    try:
        import apprise

        plugin = apprise.Apprise.instantiate(url)
    except Exception:
        return False
    return plugin is not None and "host" in getattr(type(plugin), "template_tokens", {})


def redact(url: str) -> str:
    """``url`` with every part that can hold a secret replaced by ``***``: the password of
    ``user:password@``, the whole ``user@host`` part when apprise reads the host as a credential
    (see :func:`_host_is_a_host`; a port is kept with a host), every path segment (``json://``,
    ``xml://`` and ``form://`` webhooks carry their secret there), every query value
    (``?token=``) and the fragment. Keeps the scheme, the user, a real host and the query keys,
    enough to tell the channels apart (``slack://***/***/***``, ``json://host:8080/***?token=***``).
    """
    if "://" not in url:
        return MASK
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:  # a port that is no number (a token): keep the scheme alone
        return f"{url.partition('://')[0]}://{MASK}"
    netloc = ""
    if parts.netloc and not _host_is_a_host(url):  # the user and the host are credentials here
        netloc = MASK
    elif parts.netloc:
        if parts.username is not None:
            netloc = parts.username + (f":{MASK}" if parts.password is not None else "") + "@"
        netloc += (parts.hostname or "") + (f":{port}" if port is not None else "")
    path = "/".join(MASK if segment else "" for segment in parts.path.split("/"))
    query = "&".join(
        f"{k}={MASK}" if sep else k for k, sep, _ in (q.partition("=") for q in parts.query.split("&") if q)
    )
    return f"{parts.scheme}://{netloc}{path}" + (f"?{query}" if query else "") + (f"#{MASK}" if parts.fragment else "")


def read_url_file(path: Path) -> list[str]:
    """The notification URLs in ``path``: one per line; blank lines and lines starting with ``#``
    are skipped.

    Raises:
        WatchError: the file cannot be read, belongs to another user or can be read by others
            than its owner (it holds credentials: ``chmod 600 FILE``).
    """
    path = Path(path)
    try:
        st = path.stat()
        if st.st_uid != os.geteuid():
            raise WatchError(f"--notify-file {path}: belongs to uid {st.st_uid}, not to this user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise WatchError(
                f"--notify-file {path}: others can read it (mode {oct(stat.S_IMODE(st.st_mode))}); "
                f"it holds credentials: chmod 600 {path}"
            )
        lines = path.read_text().splitlines()
    except OSError as e:
        raise WatchError(f"--notify-file {path}: {e.strerror or e}") from None
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def urls_from_environ(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The notification URLs in ``TRAINGUARD_NOTIFY`` (separated by whitespace; none when unset)."""
    return (os.environ if env is None else env).get(NOTIFY_ENV, "").split()


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
        """The URL with its secrets masked (:func:`redact`)."""
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
                failures.append(Failure(url, self.shown(url), f"{type(e).__name__}: {e}".replace(url, self.shown(url))))
                continue
            if not result:
                failures.append(Failure(url, self.shown(url), _reason(result).replace(url, self.shown(url))))
        return failures


def _reason(result: Any) -> str:
    """The warnings apprise recorded for a failed send (apprise ≥ 2 keeps them on the result)."""
    try:
        messages = [e.message for e in result.logs() if e.level in ("WARNING", "ERROR", "CRITICAL")]
    except Exception:
        messages = []
    return "; ".join(dict.fromkeys(messages)) or "apprise reported a failure"
