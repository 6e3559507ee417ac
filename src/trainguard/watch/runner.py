"""One watch pass, the loop, and ``main`` (the body of ``trainguard watch RUN_DIR``).

A pass runs every check, records the checkpoint directory's size, sends what changed (see
:mod:`trainguard.watch.alerts`), saves ``RUN_DIR/watch_state.json`` and prints one line per
condition: ``NAME: STATUS: MESSAGE``. Alerts are reported, not failures: the exit code is 0.
"""

from __future__ import annotations

import datetime
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from ..events import run_dir_problem
from ..exitcodes import ExitCode
from ..sections import parse_duration
from .alerts import Alerter, Outcome
from .conditions import ALERT, Condition, fmt_seconds
from .config import WatchSection, section_from_overrides
from .disk import dir_bytes, filesystem_conditions, headroom, targets
from .errors import WatchError
from .growth import growth_per_day, span_seconds
from .hang import hang_condition
from .memory import memory_condition
from .notify import NOTIFY_ENV, Notifier, read_url_file, redact, urls_from_environ
from .slurm import job_condition
from .state import WatchState, locked

BAD_INPUT = int(ExitCode.BAD_INPUT)


def _guarded(name: str, check: Callable[[], list[Condition]]) -> list[Condition]:
    """Run a check; an unexpected error becomes an alert (a blind watchdog must say so)."""
    try:
        return check()
    except Exception as e:
        return [Condition(name, ALERT, f"check failed: {type(e).__name__}: {e}", {"check_failed": True})]


def collect(run_dir: Path, section: WatchSection, state: WatchState, now: float) -> list[Condition]:
    """Run every check; records the checkpoint directory's size in ``state``."""
    found = targets(run_dir, section)

    def filesystems() -> list[Condition]:
        conditions, free = filesystem_conditions(found, section)
        size = dir_bytes(found[0].path)
        state.add_sample(now, size)
        rate = growth_per_day(state.samples)
        if free is not None:
            conditions.append(
                headroom(
                    "headroom[checkpoints]", free, size, rate, span_seconds(state.samples), len(state.samples), section
                )
            )
        return conditions

    return (
        _guarded("disk", filesystems)
        + _guarded("job", lambda: [job_condition(section)])
        + _guarded("hang", lambda: [hang_condition(run_dir, section, now)])
        + _guarded("memory", lambda: [memory_condition(section)])
    )


def report_lines(conditions: list[Condition], outcome: Outcome) -> list[str]:
    """One line per condition, with what the pass did about it."""
    lines = []
    for c in conditions:
        line = c.line()
        if c.name in outcome.new:
            line += " [new alert]"
        elif c.name in outcome.held:
            line += f" [alerting for {fmt_seconds(outcome.held[c.name])}]"
        elif c.name in outcome.recovered:
            line += f" [recovered after {fmt_seconds(outcome.recovered[c.name])}]"
        lines.append(line)
    shown = {c.name for c in conditions}
    lines += [f"{name}: recovered: no longer checked" for name in outcome.recovered if name not in shown]
    return lines


def run_pass(run_dir: Path, section: WatchSection, notifier: Notifier, out: Optional[TextIO] = None) -> list[Condition]:
    """One pass: check, alert/recover, save the state, print the lines to ``out`` (default stdout)."""
    run_dir = Path(run_dir)
    with locked(run_dir):
        state = WatchState.load(run_dir)
        now = time.time()
        conditions = collect(run_dir, section, state, now)
        alerter = Alerter(run_dir, notifier)
        try:
            outcome = alerter.settle(conditions, state, now)
        finally:
            alerter.close()
        try:
            state.save(run_dir)
        except OSError as e:  # e.g. the full disk being reported: the alerts went out
            print(f"trainguard: warning: could not save the watch state: {e}", file=sys.stderr)
    out = out or sys.stdout
    for line in report_lines(conditions, outcome):
        print(line, file=out)
    out.flush()
    return conditions


def watch_loop(run_dir: Path, section: WatchSection, notifier: Notifier, every: float) -> None:
    """A pass every ``every`` seconds until SIGINT or SIGTERM (the pass in progress finishes first)."""
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.is_set():
            print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}", flush=True)
            run_pass(run_dir, section, notifier)
            stop.wait(every)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_run_dir(run_dir: Path) -> None:
    problem = run_dir_problem(run_dir, writable=True)
    if problem is not None:
        raise WatchError(f"{problem} (the watch keeps watch_state.json and its events there)")


def main(
    run_dir: Path,
    overrides: list[str],
    notify: list[str],
    every: Optional[str],
    once: bool,
    notify_file: Optional[Path] = None,
) -> int:
    """``trainguard watch RUN_DIR``: one pass (``once``, or no interval set), else a pass every
    ``every`` (seconds or ``"5m"``; default the ``every`` setting) until SIGINT/SIGTERM.

    Args:
        run_dir: the run directory.
        overrides: ``key=value`` settings of :class:`WatchSection` (values read as TOML, else text).
        notify: extra apprise URLs, added to the ``notify`` setting (with those of ``notify_file``
            and of ``TRAINGUARD_NOTIFY``, :mod:`.notify`).
        every: seconds between passes, overriding the ``every`` setting.
        once: one pass even if an interval is set.
        notify_file: a file of its owner's only with one URL per line (``--notify-file``).
    Returns:
        0 (alerts are reported, not failures); 2 on bad input, with ``trainguard: error: ...`` on stderr.
    """
    run_dir = Path(run_dir)
    try:
        section = section_from_overrides(overrides)
        on_command_line = [*notify, *section.notify]  # --notify and --set notify=...: both in ps
        if any(redact(u) != u for u in on_command_line):
            print(
                "trainguard: warning: a --notify or --set notify URL holds a secret that every user sees in the "
                f"process list; give it in a file of yours (--notify-file, mode 0600) or in {NOTIFY_ENV}",
                file=sys.stderr,
            )
        notify = [*notify, *(read_url_file(notify_file) if notify_file is not None else []), *urls_from_environ()]
        if notify:
            section = section_from_overrides([], {**section.model_dump(), "notify": [*section.notify, *notify]})
        try:
            interval = parse_duration(every) if every is not None else section.every
        except ValueError as e:
            raise WatchError(f"--every: {e}") from None
        if interval is not None and interval <= 0:
            raise WatchError(f"--every: expected a positive interval, got {every!r}")
        _check_run_dir(run_dir)
        notifier = Notifier(section.notify)
    except WatchError as e:
        print(f"trainguard: error: {e}", file=sys.stderr)
        return BAD_INPUT
    if once or interval is None:
        run_pass(run_dir, section, notifier)
    else:
        watch_loop(run_dir, section, notifier, interval)
    return 0
