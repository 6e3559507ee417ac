"""The parent-death wrapper the launcher starts its ranks through (trainguard.launcher.deathsig), on real
processes: the program runs in place with the signal set, it dies with its parent, and a wrapper whose
launcher is already gone never runs the program."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from conftest import wait_for
from trainguard.launcher import deathsig

pytestmark = pytest.mark.skipif(not deathsig.supported(), reason="prctl(PR_SET_PDEATHSIG) is Linux-only")

# prints its pid, its parent-death signal (prctl PR_GET_PDEATHSIG = 2) and its arguments
REPORT = (
    "import ctypes, os, sys; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); "
    "print(os.getpid(), v.value, sys.argv[1:])"
)


def test_program_runs_in_place_with_the_parent_death_signal_set():
    proc = subprocess.Popen(
        deathsig.wrap(os.getpid(), [sys.executable, "-c", REPORT, "a b", "--c"]), stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.strip().split(maxsplit=2) == [str(proc.pid), str(int(signal.SIGKILL)), "['a b', '--c']"]


def test_child_dies_with_its_sigkilled_parent(tmp_path):
    # a stand-in launcher: starts a wrapped, long-sleeping child in a session of its own (as torch
    # elastic does), prints the child's pid and waits to be killed
    parent_code = (
        "import os, subprocess, sys, time; from trainguard.launcher import deathsig; "
        "p = subprocess.Popen(deathsig.wrap(os.getpid(), ['/bin/sleep', '300']), start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(300)"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        wait_for(lambda: child.name() == "sleep", timeout=30, what="the child to exec sleep")
        parent.kill()
        parent.wait()
        wait_for(
            lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
            timeout=5,
            what="the child to die with its parent",
        )
    finally:
        if child.is_running():
            child.kill()


def test_wrapper_whose_launcher_is_gone_does_not_run_the_program(tmp_path):
    marker = tmp_path / "ran"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is not the wrapper's parent: its "launcher" died before the prctl
    proc = subprocess.run(deathsig.wrap(gone.pid, ["/usr/bin/touch", str(marker)]), timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not marker.exists()


def test_bad_use_is_named():
    with pytest.raises(ValueError, match="absolute program path"):
        deathsig.wrap(os.getpid(), ["sleep", "1"])
    proc = subprocess.run([sys.executable, deathsig.__file__], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
    missing = subprocess.run(
        deathsig.wrap(os.getpid(), ["/nonexistent/program"]), capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == deathsig.EXEC_FAILED and "/nonexistent/program" in missing.stderr
