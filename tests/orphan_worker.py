"""A rank that outlives its launcher, run as a script under ``trainguard run`` by tests/test_launcher.py.

``trainguard run`` starts every rank with a parent-death signal, so a rank whose launcher dies is
SIGKILLed at once; the one rank that survives it is one stuck in the kernel (state D), which a test
cannot produce on demand. This script stands in for it: it clears its parent-death signal
(``prctl(PR_SET_PDEATHSIG, 0)``), writes ``READY_FILE`` (its pid) and waits until it is killed
(at most ``LIFETIME`` seconds, so a failed test leaves no process behind for long).

Usage: ``orphan_worker.py READY_FILE`` (``orphan_worker.py --exit``: exit 0 at once).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

PR_SET_PDEATHSIG = 1
LIFETIME = 120.0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--exit"]:
        return 0
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG, 0) failed")
    with open(argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(argv[1] + ".tmp", argv[1])
    deadline = time.monotonic() + LIFETIME
    while time.monotonic() < deadline:
        time.sleep(0.5)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
