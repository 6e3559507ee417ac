"""``trainguard demo``: train the example GPT twice, once cleanly and once with faults, and compare.

The faulted run gets SIGTERM at about 1/3 of ``train.max_steps`` (preemption: the launcher must
exit with 75 and a relaunch resumes), then SIGKILL of local rank 1 at about 2/3 (with in-process
recovery, on in the demo, rank 0 keeps running and a warm spare takes rank 1's place with the
state from rank 0's memory; with ``--set recovery.in_process=false`` the launcher restarts the
group from the newest valid checkpoint). The demo then prints the steps lost, the
recovery times, both validation losses and whether both final states are bitwise identical.

Layout of ``RUN_DIR``: ``clean/`` and ``faults/`` (run directories, emptied first), ``clean.log``
and ``faults.log`` (the launches' console output).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import trainguard

from .config import ConfigError, load_config
from .events import read_events
from .exitcodes import ExitCode, describe

# what the demo turns on beyond the example's defaults (a user's --set comes after and wins):
# in-process recovery, so that the SIGKILL costs neither the survivors nor a completed step
DEMO_SETTINGS = ("recovery.in_process=true",)
LAUNCH_TIMEOUT = 600.0  # seconds one launch may take before the demo kills it
POLL = 0.2
_STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")
console = Console()


@dataclass
class Launch:
    """What the demo saw of one ``trainguard run``."""

    code: Optional[int]  # exit code, None on timeout
    expected: int
    started: float  # Unix time of the Popen
    fault_time: Optional[float] = None
    fault_step: Optional[int] = None  # highest logged step when the fault was injected


def example_script() -> Path:
    """The example GPT: ``examples/gpt.py``, shipped in the package as ``trainguard/examples/gpt.py``
    (a link to it in a source checkout, a copy in a wheel)."""
    script = Path(trainguard.__file__).resolve().parent / "examples" / "gpt.py"
    if not script.is_file():
        raise ConfigError(f"the demo needs the example {script}, which is missing from this installation")
    return script


def load_example_config(script: Path, overrides: list[str]):
    """Validate ``overrides`` against the example's ``GPTConfig`` (raises ConfigError on a bad key)."""
    name = "_trainguard_demo_gpt"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the postponed annotations through sys.modules
    spec.loader.exec_module(module)
    return load_config(None, overrides, module.GPTConfig)


def fault_steps(max_steps: int, log_interval: int, ckpt_interval: int) -> tuple[int, int]:
    """Logged steps at which to send SIGTERM (~1/3) and SIGKILL (~2/3, off a checkpoint step if possible)."""

    def logged_at_least(step: float) -> int:
        return max(1, math.ceil(step / log_interval)) * log_interval

    term_at, kill_at = logged_at_least(max_steps / 3), logged_at_least(2 * max_steps / 3)
    kill_at = max(kill_at, term_at + log_interval)
    # a kill right after a scheduled save loses nothing; one log line later shows the lost work
    if kill_at % ckpt_interval == 0 and (kill_at + log_interval) % ckpt_interval and kill_at + log_interval < max_steps:
        kill_at += log_interval
    if kill_at >= max_steps:
        raise ConfigError(
            f"train.max_steps={max_steps} is too short for the demo with train.log_interval="
            f"{log_interval}: use at least {3 * log_interval + 1}"
        )
    return term_at, kill_at


def reset(run_dir: Path) -> None:
    """Delete ``run_dir/clean`` and ``run_dir/faults`` (nothing else) and create ``run_dir``."""
    for sub in ("clean", "faults"):
        path = run_dir / sub
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    run_dir.mkdir(parents=True, exist_ok=True)


class LogTail:
    """Follows a log file from its current end and reports the last ``step N/M`` line of rank 0."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial, self.step = path, path.stat().st_size, "", None

    def poll(self) -> Optional[int]:
        """Read what was appended; return the latest logged step (None before the first)."""
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = self.partial + f.read()
            self.offset = f.tell()
        *lines, self.partial = text.split("\n")
        for line in lines:
            if m := _STEP_LINE.match(line):
                self.step = int(m.group(1))
        return self.step


def stop_launch(proc: subprocess.Popen, grace: float = 90.0) -> None:
    """End a launch and its ranks: SIGTERM (the ranks save and exit), then SIGKILL what is left."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    try:
        proc.terminate()
        proc.wait(grace)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    finally:
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()


def run_launch(
    cmd: list[str],
    log: Path,
    progress: Progress,
    task: int,
    expected: int,
    trigger: Optional[tuple[int, Callable[[subprocess.Popen, Launch], bool]]] = None,
) -> Launch:
    """Run one launch with its output appended to ``log``, updating the progress bar from the log.

    ``trigger`` is ``(step, action)``: ``action(proc, launch)`` runs once when the log reaches ``step``
    and returns whether it injected the fault (recorded in ``fault_time``/``fault_step``).
    """
    with open(log, "a") as out:
        out.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n")
        out.flush()
        tail, result = LogTail(log), Launch(code=None, expected=expected, started=time.time())
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            step = tail.poll()
            if step is not None:
                progress.update(task, completed=step)
            if trigger and step is not None and step >= trigger[0]:
                t, action, trigger = time.time(), trigger[1], None
                if action(proc, result):
                    result.fault_time, result.fault_step = t, step
            time.sleep(POLL)
        result.code = proc.poll()
        if result.code is None:
            console.print(f"[red]launch timed out after {LAUNCH_TIMEOUT:.0f} s; stopping it[/red]")
    finally:
        if proc.poll() is None:
            stop_launch(proc)
    if (step := tail.poll()) is not None:
        progress.update(task, completed=step)
    progress.stop_task(task)
    if result.code != expected:  # show the end of the log
        text = log.read_text(errors="replace").splitlines()[-25:]
        console.print(f"[yellow]--- last {len(text)} lines of {log} ---[/yellow]")
        console.print("\n".join(text), markup=False, highlight=False)
    return result


def events_after(run_dir: Path, kind: str, t: float) -> list[dict]:
    """Events of ``kind`` written at or after Unix time ``t``."""
    return [e for e in read_events(run_dir, kind) if e["time"] >= t]


def kill_rank(run_dir: Path, since: float, local_rank: int = 1) -> bool:
    """SIGKILL ``local_rank`` of the newest worker group started since ``since``; False if not found."""
    started = events_after(run_dir, "workers_started", since)
    pid = started[-1]["details"]["pids"].get(str(local_rank)) if started else None
    if pid is None:
        console.print(f"[red]no pid of local rank {local_rank} in {run_dir}/events.jsonl[/red]")
        return False
    try:
        os.kill(int(pid), signal.SIGKILL)
    except ProcessLookupError:
        console.print(f"[red]local rank {local_rank} (pid {pid}) is already gone[/red]")
        return False
    return True


def fault_rows(faults: Path, term: Launch, relaunch: Launch) -> list[tuple[str, ...]]:
    """Table rows (fault, step, resumed from, steps lost, recovery) for the two faults."""
    rows = []
    stop = events_after(faults, "stop_requested", term.started)
    step = stop[0]["step"] if stop else term.fault_step
    resume = events_after(faults, "resume", relaunch.started)
    start = events_after(faults, "start", relaunch.started)
    recover = f"{start[0]['time'] - relaunch.started:.1f} s after relaunch" if start else "-"
    if term.fault_time is not None:
        recover += f"\n(relaunched after {relaunch.started - term.fault_time:.1f} s)"
    rows.append(("SIGTERM → requeue", str(step), *_resumed(resume, step), recover))
    if relaunch.fault_time is None:
        return rows + [("SIGKILL rank 1", "not injected", "-", "-", "-")]
    recovered = [e for e in events_after(faults, "recovery_finished", relaunch.fault_time) if e["rank"] is not None]
    if recovered:  # in-process: the survivors kept their state, a replacement took rank 1's place
        done = recovered[0]
        recover = f"{done['time'] - relaunch.fault_time:.2f} s after kill\n(in-process, survivors kept)"
        kept = f"{done['step']}\n(in memory)"
        lost = str(done["details"]["steps_lost"])
        return rows + [("SIGKILL rank 1", str(relaunch.fault_step), kept, lost, recover)]
    resume = events_after(faults, "resume", relaunch.fault_time)
    start = events_after(faults, "start", relaunch.fault_time)
    recover = f"{start[0]['time'] - relaunch.fault_time:.1f} s after kill\n(group restart)" if start else "-"
    rows.append(("SIGKILL rank 1", str(relaunch.fault_step), *_resumed(resume, relaunch.fault_step), recover))
    return rows


def _resumed(resume: list[dict], fault_step: Optional[int]) -> tuple[str, str]:
    if not resume or fault_step is None:
        return "-", "-"
    from_step = resume[0]["details"]["from_step"]
    return str(from_step), str(fault_step - from_step)


def final_values(run_dir: Path) -> tuple[Optional[float], Optional[str]]:
    """(final validation loss, state SHA-256 of the successful launch) of a run directory."""
    val = [e["details"]["val_loss"] for e in read_events(run_dir, "validation")]
    sha = [
        e["details"].get("state_sha256") for e in read_events(run_dir, "launch_exit") if e["details"].get("code") == 0
    ]
    return (val[-1] if val else None), (sha[-1] if sha else None)


def report(run_dir: Path, term: Launch, relaunch: Launch) -> int:
    """Print the fault table and the comparison; return 0 if all went as expected, else 1."""
    table = Table(
        "fault",
        "at step",
        "resumed\nfrom",
        "steps\nlost",
        "time to recover",
        title="injected faults",
        caption="lost: completed steps trained again;\nrecovery: until the group trains again",
    )
    for row in fault_rows(run_dir / "faults", term, relaunch):
        table.add_row(*row)
    console.print(table)
    results = Table("run", "final validation loss", "final state sha256", title="results")
    shas = []
    for name in ("clean", "faults"):
        loss, sha = final_values(run_dir / name)
        shas.append(sha)
        results.add_row(name, f"{loss:.4f}" if loss is not None else "-", f"{sha[:16]}…" if sha else "-")
    console.print(results)
    clean_sha, fault_sha = shas
    same = clean_sha is not None and clean_sha == fault_sha
    console.print(f"bitwise identical: {'[green]yes' if same else '[red]no'}[/]")
    problems = [] if relaunch.code == 0 else [f"the relaunched faulted run ended with {_outcome(relaunch)}, expected 0"]
    if relaunch.fault_time is None:
        problems.append("the SIGKILL was never injected")
    if not same:
        problems.append("the final states differ" if clean_sha and fault_sha else "a final state hash is missing")
    for p in problems:
        console.print(f"[red]demo failed: {p}[/red]")
    return 1 if problems else 0


def run_demo(run_dir: Path, overrides: list[str]) -> int:
    """Run the demo in ``run_dir`` with ``--set`` ``overrides`` for both runs; return the exit code.

    Raises:
        ConfigError: the example is missing, an override is bad, or the run is too short.
    """
    script = example_script()
    cfg = load_example_config(script, [*DEMO_SETTINGS, *overrides])
    total = cfg.train.max_steps
    term_at, kill_at = fault_steps(total, cfg.train.log_interval, cfg.checkpoint.interval)
    run_dir = Path(run_dir).resolve()
    reset(run_dir)
    for log in ("clean.log", "faults.log"):
        (run_dir / log).write_text("")

    def command(sub: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "trainguard.cli",
            "run",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(run_dir / sub),
            str(script),
            *[a for o in (*DEMO_SETTINGS, *overrides) for a in ("--set", o)],
        ]

    console.print(f"trainguard demo: {total} steps of {script.name} on 2 ranks, twice; output in {run_dir}")
    console.print(f"faults: SIGTERM to the launcher at step {term_at}, SIGKILL of rank 1 at step {kill_at}")
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the launches on SIGTERM too
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("clean run", total=total)
            clean = run_launch(command("clean"), run_dir / "clean.log", progress, task, 0)
            if clean.code != 0:
                return _aborted("the clean run", clean, run_dir / "clean.log")
            faults, flog = run_dir / "faults", run_dir / "faults.log"
            task = progress.add_task("faults: SIGTERM → requeue", total=total)
            term = run_launch(
                command("faults"),
                flog,
                progress,
                task,
                int(ExitCode.REQUEUE),
                trigger=(term_at, lambda proc, _: proc.send_signal(signal.SIGTERM) or True),
            )
            if term.code != ExitCode.REQUEUE:
                return _aborted("the faulted run after SIGTERM", term, flog)
            task = progress.add_task("faults: SIGKILL rank 1", total=total, completed=term.fault_step or 0)
            relaunch = run_launch(
                command("faults"),
                flog,
                progress,
                task,
                0,
                trigger=(kill_at, lambda _, launch: kill_rank(faults, launch.started)),
            )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; the launches were stopped[/yellow]")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return report(run_dir, term, relaunch)


def _outcome(launch: Launch) -> str:
    return "a timeout" if launch.code is None else f"exit code {launch.code} ({describe(launch.code)})"


def _aborted(what: str, launch: Launch, log: Path) -> int:
    """Say why the demo stops early; return 1."""
    console.print(
        f"[red]demo failed: {what} ended with {_outcome(launch)}, expected {launch.expected}; see {log}[/red]"
    )
    return 1
