"""``trainguard watch``: real SMTP and HTTP servers receive the notifications, real files and
filesystems trigger the conditions (no mocks)."""

from __future__ import annotations

import email
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from pydantic import ValidationError

from trainguard.events import read_events
from trainguard.watch import WatchSection, main
from trainguard.watch.disk import targets
from trainguard.watch.growth import growth_per_day
from trainguard.watch.slurm import parse_squeue

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Inbox:
    """aiosmtpd handler keeping every message it receives."""

    def __init__(self):
        self.messages: list[email.message.Message] = []

    async def handle_DATA(self, server, session, envelope):
        self.messages.append(email.message_from_bytes(envelope.content))
        return "250 OK"


@pytest.fixture
def smtp():
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    inbox.url = f"mailto://127.0.0.1:{controller.port}?from=watch@example.com&to=ops@example.com"
    yield inbox
    controller.stop()


@pytest.fixture
def webhook():
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield bodies, f"json://127.0.0.1:{server.server_port}/hook"
    server.shutdown()
    server.server_close()


def watch(run_dir: Path, *overrides: str, notify: tuple[str, ...] = (), capsys=None) -> tuple[int, str]:
    code = main(run_dir, list(overrides), list(notify), None, True)
    out = capsys.readouterr().out if capsys else ""
    return code, out


def kinds(run_dir: Path, kind: str) -> list[dict]:
    return [e["details"] for e in read_events(run_dir, kind)]


def test_disk_alert_once_then_recovered_by_email_and_webhook(tmp_path, smtp, webhook, capsys):
    bodies, hook = webhook
    urls = (smtp.url, hook)
    over = f"min_free_bytes={shutil.disk_usage(tmp_path).free + 2**30}"

    code, out = watch(tmp_path, over, notify=urls, capsys=capsys)
    assert code == 0
    assert "disk[checkpoints]: alert:" in out and "min_free_bytes" in out
    assert len(smtp.messages) == 1 and len(bodies) == 1
    mail = smtp.messages[0]
    assert "ALERT disk[checkpoints]" in mail["Subject"]
    text = mail.get_payload()[0].get_payload(decode=True).decode()
    assert "free" in text and str(tmp_path) in text
    assert bodies[0]["type"] == "failure"
    assert "ALERT disk[checkpoints]" in bodies[0]["title"] and "< min_free_bytes" in bodies[0]["message"]

    code, out = watch(tmp_path, over, notify=urls, capsys=capsys)  # still holds: nothing sent
    assert code == 0 and "[alerting for" in out
    assert len(smtp.messages) == 1 and len(bodies) == 1

    code, out = watch(tmp_path, "min_free_bytes=1", notify=urls, capsys=capsys)  # threshold lifted
    assert code == 0 and "disk[checkpoints]: ok:" in out and "[recovered after" in out
    assert len(smtp.messages) == 2 and len(bodies) == 2
    assert "RECOVERED disk[checkpoints]" in smtp.messages[1]["Subject"]
    assert bodies[1]["type"] == "success" and "RECOVERED disk[checkpoints]" in bodies[1]["message"]

    alerts, recovered = kinds(tmp_path, "watch_alert"), kinds(tmp_path, "watch_recovered")
    assert [a["condition"] for a in alerts] == ["disk[checkpoints]"]
    assert alerts[0]["values"]["free"] < alerts[0]["values"]["min_free_bytes"]
    assert [r["condition"] for r in recovered] == ["disk[checkpoints]"]
    assert not kinds(tmp_path, "watch_notify_failed")


def test_inode_threshold(tmp_path, capsys):
    st = os.statvfs(tmp_path)
    if st.f_files == 0:
        pytest.skip("this filesystem reports no inode counts")
    used = 100.0 * (st.f_files - st.f_ffree) / st.f_files
    code, out = watch(tmp_path, f"max_inodes_percent={max(used - 0.01, 1e-6)}", capsys=capsys)
    assert code == 0 and "inodes[checkpoints]: alert:" in out and "max_inodes_percent" in out
    [alert] = kinds(tmp_path, "watch_alert")
    assert alert["condition"] == "inodes[checkpoints]"
    assert alert["values"]["inodes_used_percent"] > alert["values"]["max_inodes_percent"]


def test_days_of_headroom_from_measured_growth(tmp_path, capsys):
    code, out = watch(tmp_path, "min_days=1e12", capsys=capsys)
    assert "headroom[checkpoints]: skipped: growth not measured yet" in out
    step = tmp_path / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    (step / "shard.bin").write_bytes(os.urandom(2**20))
    state_file = tmp_path / "watch_state.json"
    state = json.loads(state_file.read_text())
    state["samples"][0][0] -= 86400  # the first pass a day ago
    state_file.write_text(json.dumps(state))

    code, out = watch(tmp_path, "min_days=1e12", capsys=capsys)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("headroom[checkpoints]"))
    assert "alert" in line and "growing 1.0 MiB/day" in line and "days of headroom" in line
    [alert] = kinds(tmp_path, "watch_alert")
    assert alert["condition"] == "headroom[checkpoints]"
    assert alert["values"]["growth_bytes_per_day"] == pytest.approx(2**20, rel=0.01)
    assert alert["values"]["checkpoint_bytes"] == 2**20

    code, out = watch(tmp_path, "min_days=1", capsys=capsys)
    assert "headroom[checkpoints]: ok:" in out
    assert [r["condition"] for r in kinds(tmp_path, "watch_recovered")] == ["headroom[checkpoints]"]


def test_growth_rate_and_checkpoint_dir():
    assert growth_per_day([[0, 0]]) is None
    assert growth_per_day([[0, 0], [0.5, 100]]) is None
    assert growth_per_day([[0, 0], [43200, 50], [86400, 100]]) == pytest.approx(100)
    assert growth_per_day([[0, 100], [86400, 0]]) < 0


def test_checkpoint_dir_from_run_config(tmp_path):
    (tmp_path / "config.toml").write_text('[checkpoint]\ndir = "ckpt"\n')
    found = targets(tmp_path, WatchSection(paths=["/"]))
    assert [t.role for t in found] == ["checkpoints", "run_dir", "/"]
    assert found[0].path == tmp_path / "ckpt"


def _event(kind: str, t: float) -> str:
    return json.dumps({"time": t, "rank": 0, "kind": kind, "step": None, "attempt": 0, "pid": 1, "details": {}}) + "\n"


def test_hang_until_the_run_ended(tmp_path, capsys):
    now = time.time()
    events = tmp_path / "events.jsonl"
    events.write_text(_event("launch", now - 9000) + _event("progress", now - 7200) + "{cut line\n")
    code, out = watch(tmp_path, capsys=capsys)
    assert code == 0
    assert "hang: alert: newest event 'progress' 2.0 h ago (> max_silence 30.0 min)" in out
    code, out = watch(tmp_path, capsys=capsys)  # its own watch_alert event is no sign of life
    assert "hang: alert:" in out and "[alerting for" in out

    with open(events, "a") as f:
        f.write(_event("launch_exit", now - 7100))
    code, out = watch(tmp_path, capsys=capsys)
    assert "hang: ok: the run has ended" in out
    assert [a["condition"] for a in kinds(tmp_path, "watch_alert")] == ["hang"]
    assert [r["condition"] for r in kinds(tmp_path, "watch_recovered")] == ["hang"]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "events.jsonl").write_text(_event("progress", now - 5))
    code, out = watch(fresh, "max_silence=60", capsys=capsys)
    assert "hang: ok: newest event 'progress'" in out


def test_job_skipped_without_squeue(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code, out = watch(tmp_path, "job_name=my-training-10b", "job_id=87", capsys=capsys)
    assert code == 0 and "job: skipped: squeue not found" in out
    assert not kinds(tmp_path, "watch_alert")


def test_parse_squeue():
    text = "87|RUNNING|my-training-10b\n88|PENDING|my|odd|name\n\ngarbage\n 89 | completing |x\n"
    assert parse_squeue(text) == [
        ("87", "RUNNING", "my-training-10b"),
        ("88", "PENDING", "my|odd|name"),
        ("89", "COMPLETING", "x"),
    ]


def test_failed_notification_is_a_warning_and_retried(tmp_path, capsys):
    url = f"json://127.0.0.1:{free_port()}/nobody"
    code = main(tmp_path, ["max_memory_percent=0.001"], [url], None, True)
    captured = capsys.readouterr()
    assert code == 0 and "memory: alert:" in captured.out
    assert "trainguard: warning: could not send the alert for memory" in captured.err
    code = main(tmp_path, ["max_memory_percent=0.001"], [url], None, True)
    failed = kinds(tmp_path, "watch_notify_failed")
    assert code == 0 and len(failed) == 2 and failed[0]["condition"] == "memory"
    assert len(kinds(tmp_path, "watch_alert")) == 1


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(tmp_path, [], ["notaservice://x"], None, True) == 2
    err = capsys.readouterr().err
    assert "trainguard: error: invalid notification URL 'notaservice://***': apprise does not recognise it" in err
    assert not (tmp_path / "watch_state.json").exists()  # nothing ran

    assert main(tmp_path, ["max_usd_percent=5"], [], None, True) == 2
    assert "max_usd_percent: unknown key" in capsys.readouterr().err
    assert main(tmp_path, ["max_used_percent=150"], [], None, True) == 2
    assert "max_used_percent" in capsys.readouterr().err
    assert main(tmp_path, ["min_free_bytes=lots"], [], None, True) == 2
    assert "min_free_bytes" in capsys.readouterr().err
    assert main(tmp_path, ["max_silence"], [], None, True) == 2
    assert "expected key=value" in capsys.readouterr().err
    assert main(tmp_path, [], [], "soon", False) == 2
    assert "--every" in capsys.readouterr().err
    assert main(tmp_path / "missing", [], [], None, True) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="max_inodes_percent"):
        WatchSection(max_inodes_percent=0)
    section = WatchSection(every="5m", min_free_bytes="2GiB", max_silence="01:00:00", job_id=123, notify="json://h/x")
    assert (section.every, section.min_free_bytes, section.max_silence) == (300, 2 * 2**30, 3600)
    assert (section.job_id, section.notify) == ("123", ["json://h/x"])


def test_loop_until_sigterm(tmp_path):
    code = (
        f"import sys; from pathlib import Path; from trainguard.watch import main; "
        f"sys.exit(main(Path({str(tmp_path)!r}), [], [], '0.2', False))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    state = tmp_path / "watch_state.json"
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if state.exists() and len(json.loads(state.read_text())["samples"]) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert out.decode().count("memory: ok:") >= 2
