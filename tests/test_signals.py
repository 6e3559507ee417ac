"""ShutdownHandler: the handler only records; the hard deadline exits a stuck process with 75."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from trainguard.exitcodes import ExitCode

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from trainguard.stop.signals import ShutdownHandler
    marker = Path(sys.argv[1])
    h = ShutdownHandler(["SIGTERM", "SIGUSR1"], deadline=1.0, on_deadline=lambda: marker.write_text(h.received)).install()
    print("ready", flush=True)
    while h.received is None:
        time.sleep(0.01)
    print("recorded", h.received, flush=True)
    time.sleep(60)   # an emergency save that never finishes
""")


def test_deadline_exits_stuck_process_with_requeue_code(tmp_path):
    marker = tmp_path / "deadline"
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    p.send_signal(15)
    assert p.stdout.readline().strip() == "recorded SIGTERM"
    assert p.wait(timeout=30) == ExitCode.REQUEUE
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 10, elapsed
    assert marker.read_text() == "SIGTERM"
