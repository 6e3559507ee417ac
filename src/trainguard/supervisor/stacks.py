"""Python stacks of a rank's threads, taken while its main thread stands still.

Each rank registers ``faulthandler`` for :data:`STACK_SIGNAL` (SIGUSR2), writing into a file
next to its heartbeat record (:func:`stack_path`); :func:`dump_stacks` makes it write and copies
the file into the run directory. Used for hung ranks and for busy ones (``slow_section``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

STACK_SIGNAL = signal.SIGUSR2
STACK_QUIET = 0.5  # seconds without growth that end a stack dump whose end was not seen
# faulthandler dumps the threads newest first, so the main thread comes last and its outermost frame
# (a script's ``<module>``, ``python -m``'s ``_run_module_as_main``) is the dump's last line
MAIN_BOTTOM = ("in <module>", "in _run_module_as_main")


# tgkill(2) by machine: a signal to one thread (the main thread's id is the process id)
TGKILL = {"x86_64": 234, "aarch64": 131}


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of process ``pid`` (``tgkill``), so that faulthandler's handler
    runs *in* the main thread and its stack is read while it stands still; a process-directed
    signal may be handled by any thread while the main thread runs on, and a dump of a running
    thread comes out cut short. Falls back to ``os.kill`` where ``tgkill`` is not known.

    Raises:
        ProcessLookupError: no such process.
    """
    number = TGKILL.get(os.uname().machine)
    if number is None:
        os.kill(pid, sig)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, pid, sig) != 0:
        err = ctypes.get_errno()
        raise ProcessLookupError(err, os.strerror(err)) if err == errno.ESRCH else OSError(err, os.strerror(err))


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` now (the ``SigCgt`` mask of
    ``/proc/PID/status``); ``False`` when it cannot be read (no such process). A process without
    one would die of :data:`STACK_SIGNAL` (its default action), as a replacement rank would before
    its Guard registered faulthandler."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next((line.split()[1] for line in f if line.startswith("SigCgt:")), "0")
    except OSError:
        return False
    return bool(int(mask, 16) >> (sig - 1) & 1)


def dump_complete(text: str) -> bool:
    """True when a faulthandler dump of all threads has reached the main thread's outermost frame."""
    lines = text.rstrip().splitlines()
    return bool(lines) and lines[-1].rstrip().endswith(MAIN_BOTTOM)


def main_stack(text: str) -> Optional[str]:
    """The main thread's stack in the newest dump of a stack file (faulthandler writes the main
    thread last: the last ``Thread 0x…``/``Current thread 0x…`` block), without its thread id;
    ``None`` when the text holds no complete dump."""
    if not dump_complete(text):
        return None
    start = max(text.rfind("Thread 0x"), text.rfind("thread 0x"))
    return text[text.index("\n", start) + 1 :].rstrip() if start >= 0 else None


def stack_path(directory: str | os.PathLike, local_rank: int) -> Path:
    """Where a rank's faulthandler writes its stacks (next to its heartbeat record)."""
    return Path(directory) / f"rank-{local_rank}.stack"


def dump_stacks(src: Path, dest: Path, pid: Optional[int], wait: float) -> Optional[Path]:
    """Make process ``pid`` dump the stacks of all its threads into its stack file ``src``
    (SIGCONT first wakes a stopped process) and copy that file to ``dest``.

    faulthandler writes frame by frame from the signal handler and marks no end: this waits until
    the main thread's outermost frame is written (it comes last), or, for a main thread without
    one, until the file has stopped growing for :data:`STACK_QUIET` seconds; all within ``wait``
    seconds (``[supervisor] stacks_wait``: a loaded machine may deschedule the rank mid-dump).

    Returns:
        ``dest``, or ``None`` when there is no process, no stack file, no handler for the dump
        signal in the process (:func:`catches`: it is not sent, it would end the process), no
        room for the copy, or an empty copy.
    """
    if pid is None or not src.exists() or not catches(pid, STACK_SIGNAL):
        return None
    before = src.stat().st_size
    try:
        signal_main_thread(pid, STACK_SIGNAL)
        os.kill(pid, signal.SIGCONT)  # a stopped process handles the dump signal once continued
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + wait
    size, quiet_since = before, None
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now_size = src.stat().st_size
        if now_size != size:
            size, quiet_since = now_size, time.monotonic()
            with open(src, "rb") as f:
                f.seek(before)
                if dump_complete(f.read().decode(errors="replace")):
                    break
        elif quiet_since is not None and time.monotonic() - quiet_since >= STACK_QUIET:
            break
    try:
        dest.parent.mkdir(exist_ok=True)
        shutil.copyfile(src, dest)
    except OSError:  # a full run directory: no copy (the hang is handled all the same)
        return None
    return dest if dest.stat().st_size > 0 else None
