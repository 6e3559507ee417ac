"""Notification URLs are credentials (issue 46): read from a file of the user's own or the
environment, never printed or recorded unmasked; redact() masks apprise's URL forms."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO
from trainguard.events import read_events
from trainguard.watch.errors import WatchError
from trainguard.watch.notify import read_url_file, redact, urls_from_environ

SECRET = "S3cr3tT0k3n"

# (an apprise URL with SECRET in each place a credential goes, what redact() shows of it)
FORMS = [
    (f"slack://{SECRET}A/{SECRET}B/{SECRET}C", "slack://***/***/***"),
    (f"slack://{SECRET}A/{SECRET}B/{SECRET}C/#general", "slack://***/***/***/#***"),
    (f"discord://123456/{SECRET}", "discord://***/***"),
    (f"tgram://123456:{SECRET}/987", "tgram://***"),
    (f"pover://{SECRET}user@{SECRET}", "pover://***"),
    (f"msteams://{SECRET}/{SECRET}/{SECRET}", "msteams://***/***/***"),
    (f"json://user:{SECRET}@hooks.example.com:8080/hook/{SECRET}?token={SECRET}", None),
    (f"jsons://hooks.example.com/{SECRET}", None),
    (f"xml://hooks.example.com/path?token={SECRET}", "xml://hooks.example.com/***?token=***"),
    (f"form://hooks.example.com/{SECRET}", "form://hooks.example.com/***"),
    (f"mailto://ops:{SECRET}@mail.example.com?to=ops@example.com", "mailto://ops:***@mail.example.com?to=***"),
    (f"mailtos://ops:{SECRET}@smtp.example.com:587?from=a@example.com&to=b@example.com", None),
    (f"https://hooks.example.com/{SECRET}?key={SECRET}", "https://***/***?key=***"),
    ("no scheme at all " + SECRET, "***"),
]


@pytest.mark.parametrize("url, shown", FORMS)
def test_redact_masks_every_credential_of_apprises_url_forms(url, shown):
    masked = redact(url)
    assert SECRET not in masked, masked
    if shown is not None:
        assert masked == shown
    assert masked.split("://")[0] == url.split("://")[0] or "://" not in url  # the channel's kind stays visible


def test_redact_keeps_a_webhooks_host_and_port():
    assert redact(f"json://user:{SECRET}@hooks.example.com:8080/hook/{SECRET}?token={SECRET}") == (
        "json://user:***@hooks.example.com:8080/***/***?token=***"
    )


_token = st.text(alphabet=st.characters(categories=("L", "N"), max_codepoint=0x7F), min_size=6, max_size=30)


@settings(deadline=None)  # a loaded machine took 514 ms for one example (the default deadline is 200 ms)
@given(a=_token, b=_token, c=_token, path=_token, query=_token, password=_token)
def test_no_credential_survives_redaction(a, b, c, path, query, password):
    """Property: a token in any credential place of a Slack, Discord, JSON or e-mail URL is not
    in what is printed (tokens of 6+ letters and digits: a shorter one could be a host name's part)."""
    for url, secrets in [
        (f"slack://{a}/{b}/{c}", (a, b, c)),
        (f"discord://{a}/{b}", (a, b)),
        (f"json://u:{password}@h.example.com/{path}?token={query}", (password, path, query)),
        (f"mailtos://u:{password}@smtp.example.com?to=x@example.com", (password,)),
    ]:
        masked = redact(url)
        assert not [s for s in secrets if s in masked and s not in ("example", "com")], (url, masked)


def test_a_url_file_must_be_private(tmp_path):
    path = tmp_path / "notify"
    path.write_text(f"# the team's webhook\njson://127.0.0.1:9/{SECRET}\n\n  slack://A/B/C  \n")
    path.chmod(0o644)
    with pytest.raises(WatchError, match=r"others can read it \(mode 0o644\); it holds credentials: chmod 600"):
        read_url_file(path)
    path.chmod(0o600)
    assert read_url_file(path) == [f"json://127.0.0.1:9/{SECRET}", "slack://A/B/C"]
    assert urls_from_environ({"TRAINGUARD_NOTIFY": "json://a/x\n slack://A/B/C"}) == ["json://a/x", "slack://A/B/C"]
    assert urls_from_environ({}) == []


@pytest.fixture
def webhook():
    bodies: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield bodies, server.server_port
    server.shutdown()
    server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_watch_takes_urls_from_a_private_file_and_the_environment_and_never_shows_them(tmp_path, webhook):
    """``trainguard watch RUN --notify-file F`` with ``TRAINGUARD_NOTIFY`` set: an alert reaches
    the webhook of the file and the one of the environment; a third URL (a closed port) fails, and
    its warning and ``watch_notify_failed`` event show it masked. No secret is in the command
    line, the output or the run directory."""
    bodies, port = webhook
    run = tmp_path / "run"
    run.mkdir()
    urls = tmp_path / "notify"
    urls.write_text(f"json://127.0.0.1:{port}/file-{SECRET}\njson://127.0.0.1:{_free_port()}/dead-{SECRET}\n")
    urls.chmod(0o600)
    env = {**os.environ, "TRAINGUARD_NOTIFY": f"json://127.0.0.1:{port}/env-{SECRET}"}
    cmd = [sys.executable, "-m", "trainguard.cli", "watch", str(run), "--set", "max_memory_percent=0.001"]
    done = subprocess.run(
        [*cmd, "--notify-file", str(urls)], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert sorted(path for path, _ in bodies) == [f"/env-{SECRET}", f"/file-{SECRET}"]
    assert "memory: alert:" in done.stdout
    assert f"could not send the alert for memory to json://127.0.0.1:{_port_of(done.stderr)}/***" in done.stderr
    assert SECRET not in done.stdout + done.stderr
    [failed] = [e["details"] for e in read_events(run, "watch_notify_failed")]
    assert failed["url"].endswith("/***") and SECRET not in json.dumps(failed)
    for p in run.rglob("*"):
        assert SECRET.encode() not in p.read_bytes(), p

    urls.chmod(0o640)
    refused = subprocess.run(
        [*cmd, "--notify-file", str(urls)], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert refused.returncode == 2 and "others can read it (mode 0o640)" in refused.stderr
    assert SECRET not in refused.stdout + refused.stderr


def _port_of(stderr: str) -> str:
    """The port of the masked URL in the failure warning (the dead one's)."""
    line = next(x for x in stderr.splitlines() if "could not send the alert" in x)
    return line.split("json://127.0.0.1:")[1].split("/")[0]


def test_a_secret_in_set_notify_is_warned_of_as_one_in_notify_is(tmp_path):
    """Issue 54: ``--set notify=URL?token=SECRET`` is in the process list as ``--notify`` is, but
    only ``--notify`` was warned of. Now both are."""
    run = tmp_path / "run"
    run.mkdir()
    url = f"json://127.0.0.1:{_free_port()}/hook?token={SECRET}"
    cmd = [sys.executable, "-m", "trainguard.cli", "watch", str(run), "--set", f'notify=["{url}"]']
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--set notify URL holds a secret that every user sees in the process list" in done.stderr
    assert SECRET not in done.stdout + done.stderr
