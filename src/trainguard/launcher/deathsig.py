"""Ranks never outlive their launcher: a parent-death signal set before the rank's program starts.

torch elastic starts every rank in a session of its own (``start_new_session``), so nothing stops
the ranks when their launcher dies without stopping them itself (SIGKILL, the kernel's OOM
killer): they would train on, unsupervised, into the run directory a relaunch then uses too.

The launcher therefore starts each rank through this file, run as a script (:func:`wrap`)::

    python -I -S deathsig.py LAUNCHER_PID PROGRAM [ARG...]

which

1. asks the kernel to SIGKILL this process when the thread that started it (the launcher's main
   thread) ends: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``;
2. closes the race with a launcher that died before step 1 (whose death would never be signalled):
   if the parent is no longer ``LAUNCHER_PID``, this process SIGKILLs itself;
3. replaces itself with ``PROGRAM`` (``execv``: same pid, and the setting survives the exec).

Linux only (``prctl``). This file imports only the standard library and is run by path, so it
starts in a few milliseconds and never imports trainguard or torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
EXEC_FAILED = 127  # exit code when PROGRAM cannot be executed (as a shell's)


def supported() -> bool:
    """Whether this platform has ``prctl(PR_SET_PDEATHSIG)`` (Linux)."""
    return sys.platform.startswith("linux")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when the thread that created it ends.

    The setting survives ``execve`` (of a program without set-user-ID or file capabilities) and is
    not inherited by children.

    Raises:
        OSError: not Linux, or ``prctl`` failed (the message names the error).
    """
    if not supported():
        raise OSError(f"prctl(PR_SET_PDEATHSIG) is Linux-only (this is {sys.platform})")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {int(sig)}): {os.strerror(err)}")


def wrap(launcher_pid: int, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` (``[PROGRAM, ARG...]``, PROGRAM an absolute path) under
    this file, for a process started by ``launcher_pid``.

    Raises:
        ValueError: ``argv`` is empty or its program is not an absolute path.
    """
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError(f"expected a command line starting with an absolute program path, got {argv!r}")
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(int(launcher_pid)), *argv]


def main(argv: list[str]) -> int:
    """Run as a script: ``deathsig.py LAUNCHER_PID PROGRAM [ARG...]`` (see the module docstring).
    Does not return when PROGRAM starts (it replaces this process); returns 2 on bad arguments and
    :data:`EXEC_FAILED` when PROGRAM cannot be executed (the script's exit code)."""
    if len(argv) < 3 or not argv[1].isdigit():
        print(f"usage: {argv[0]} LAUNCHER_PID PROGRAM [ARG...]", file=sys.stderr)
        return 2
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(argv[1]):  # the launcher died before the prctl: die as it would have made us
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        os.execv(argv[2], argv[2:])
    except OSError as e:
        print(f"trainguard: cannot execute {argv[2]}: {e}", file=sys.stderr, flush=True)
        return EXEC_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv))


def end_orphans(pid: int) -> bool:
    """SIGKILL what is left of the session of the rank ``pid`` that ended (torch elastic and the
    replacement runner start each rank in a session of its own, its process group numbered as its
    pid): its children that outlived it (DataLoader workers, a subprocess), which would hold its
    group connections open and outlive the run. Whether any was there; a process group that no
    longer exists, or that is not this user's, is left alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True
