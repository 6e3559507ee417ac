"""Launch the zoo's scripts under ``trainguard run`` and measure what a fault costs them.

Shared by ``tests/test_zoo.py`` (one kill and one resume per shape, CI's soak step),
``scripts/zoo_campaign.py`` (3 kills and a hang per shape) and ``benchmarks/zoo_kills.py``
(in-process against the group restart). :func:`resume_trial` is the resume arm: the whole launch
stopped (SIGTERM to the launcher, or the launcher and its ranks SIGKILLed) and the same command run
again, as a user whose job was preempted does.

A trial launches a shape with ``checkpoint.interval=10`` and the given settings (none: the defaults,
in-process recovery with a warm spare), watches rank 0's ``step N/M`` lines as they appear (each
stamped with the wall time it was read, polled every 10 ms), and at a seeded random step plus a
random fraction of a step (0-20 ms) sends one rank (seeded random) SIGKILL, or SIGSTOP for a hang
(the hang supervisor then finds it stopped and kills it). What it reports (:class:`Trial`):

* ``path``: ``in-process`` (a rank was replaced and no group restart, fallback or failed recovery
  followed), ``fallback`` (in-process recovery was on but the group restarted), ``restart`` (it was
  off), ``failed`` (the launch did not exit 0 in time);
* ``seconds``: from the fault to the first step line printed after the launcher or a rank reacted
  to it (its first ``recovery_started``, ``rank_replaced``, ``hang_detected``, ``group_restart``,
  ``recovery_fallback``, ``recovery_failed`` or ``workers_failed`` event after the fault); when the
  group restarted, after the restarted group's ``workers_started`` (a survivor may still print a
  step before its group is torn down);
* ``to_restart``: when the group restarted, from the fault to the restarted group's
  ``workers_started`` (what a fallback adds before the restart's own start-up);
* ``redone``: completed steps trained again: the newest step printed before the fault minus the
  step before the first one printed after it;
* ``bitwise``: rank 0's final weights hash (``ZOO_HASH_FILE``) equals the clean run's;
* ``replaced``: ``rank_replaced`` events in the run; ``reason``: the fallback's reason (events), and
  ``console_reason``: a ``trainguard:`` console line after the fault says the group restarts.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from trainguard.events import read_events

ZOO = Path(__file__).resolve().parent
REPO = ZOO.parents[1]
STEP_LINE = re.compile(rb"^step (\d+)/(\d+)")
REACTIONS = {
    "recovery_started",
    "rank_replaced",
    "hang_detected",
    "group_restart",
    "recovery_fallback",
    "recovery_failed",
    "workers_failed",
}
FALLBACKS = {"group_restart", "recovery_fallback", "recovery_failed"}
RESTART = ("recovery.in_process=false",)
BASE_SETTINGS = ("checkpoint.interval=10",)


@dataclass(frozen=True)
class Shape:
    """A zoo script: its file in ``tests/zoo``, its arguments, extra environment and settings."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("nanogpt", "nanogpt_train.py"),
        Shape("torchtitan", "torchtitan_trainer.py"),
        Shape("accelerate_clm", "accelerate_clm_no_trainer.py"),
        Shape("timm", "timm_train.py"),
        Shape("imagenet_ddp", "imagenet_ddp_main.py"),
        Shape("lightning", "lightning_trainer.py"),
        Shape("hf_trainer", "hf_trainer.py"),
        Shape("fsdp2", "fsdp2_fully_shard.py"),
        Shape("resume_barrier", "resume_then_barrier.py"),
        Shape("val_allreduce", "val_allreduce_every_n.py"),
        Shape("start_step_sched", "start_step_scheduler.py"),
        Shape("compiled", "torch_compile.py"),
        Shape("ddp_tutorial", "ddp_tutorial_epochs.py"),
        Shape("word_lm", "word_language_model.py"),
        Shape("run_step_barrier", "run_step_barrier.py"),
        Shape("mingpt_ddp", "mingpt_ddp_trainer.py"),
    )
}


def trainguard_cmd() -> list[str]:
    return [sys.executable, "-m", "trainguard.cli"]


def launch(shape: Shape, run: Path, settings: tuple[str, ...] = (), steps: int = 60, extra: tuple[str, ...] = ()):
    """Start ``trainguard run --nproc-per-node 2 --run-dir RUN --set ... EXTRA SCRIPT ARGS``
    (trainguard's settings and ``extra`` options, such as ``--inject``, before the script, so the
    script's own command line stays its own) for ``steps`` optimizer steps; rank 0 writes the final
    weights' hash to ``RUN.hash``; stdout and stderr go to ``RUN.log``; its own session, so
    :func:`stop` can end it and its ranks."""
    run.parent.mkdir(parents=True, exist_ok=True)
    sets = [x for s in (*BASE_SETTINGS, *shape.settings, *settings) for x in ("--set", s)]
    cmd = [*trainguard_cmd(), "run", "--nproc-per-node", "2", "--run-dir", str(run), *sets, *extra]
    cmd += [str(ZOO / shape.script), *shape.args]
    env = {**os.environ, **shape.env, "ZOO_HASH_FILE": f"{run}.hash", "ZOO_STEPS": str(steps)}
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(f"{run}.log", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """End a launch this module started (its session: the launcher and its ranks)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class StepLines:
    """Rank 0's ``step N/M`` lines of a launch's log, each with the wall time it was first read."""

    def __init__(self, log: Path):
        self.log, self.offset, self.partial = log, 0, b""
        self.lines: list[tuple[float, int]] = []

    def poll(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        now = time.time()
        *whole, self.partial = (self.partial + chunk).split(b"\n")
        for line in whole:
            m = STEP_LINE.match(line)
            if m:
                self.lines.append((now, int(m.group(1))))

    def newest(self) -> int:
        return max((s for _, s in self.lines), default=0)

    def wait_for(self, step: int, proc: subprocess.Popen, deadline: float) -> None:
        """Poll every 10 ms until rank 0 printed ``step``, the launch ended, or ``deadline``
        (``time.monotonic()``) passed."""
        while self.newest() < step and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
            self.poll()


def hash_of(path: Path) -> Optional[str]:
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None


def clean_run(shape: Shape, run: Path, timeout: float = 300, steps: int = 60) -> Optional[str]:
    """One uninterrupted launch; rank 0's final weights hash (``None``: it did not finish with 0)."""
    proc = launch(shape, run, steps=steps)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return None
    return hash_of(Path(f"{run}.hash")) if code == 0 else None


@dataclass
class Trial:
    shape: str
    fault: str
    seed: int
    code: Optional[int] = None
    path: str = "failed"
    fault_step: int = 0
    victim: int = -1
    seconds: float = float("nan")
    to_restart: float = float("nan")
    redone: int = -1
    bitwise: bool = False
    replaced: int = 0
    reason: str = ""
    console_reason: bool = False
    run: str = ""

    def row(self) -> dict:
        return asdict(self)


def fault_trial(
    shape: Shape,
    run: Path,
    seed: int,
    fault: str = "kill",
    settings: tuple[str, ...] = (),
    clean: Optional[str] = None,
    timeout: float = 300,
    steps: int = 60,
) -> Trial:
    """One launch with one fault (``kill``: SIGKILL; ``hang``: SIGSTOP) on a seeded random rank
    at a seeded random step in ``[15, steps - 15]``; see the module's docstring for the fields."""
    rng = random.Random(seed)
    at, victim = rng.randint(15, steps - 15), rng.randrange(2)
    trial = Trial(shape.name, fault, seed, victim=victim, run=str(run))
    proc = launch(shape, run, settings, steps)
    lines = StepLines(Path(f"{run}.log"))
    deadline = time.monotonic() + timeout
    try:
        lines.wait_for(at, proc, deadline)
        if proc.poll() is not None or time.monotonic() >= deadline:
            trial.code = proc.poll()
            return trial
        time.sleep(rng.random() * 0.02)
        lines.poll()
        started = [e for e in read_events(run, "workers_started")]
        pid = int(started[-1]["details"]["pids"][str(victim)])
        printed = lines.newest()
        t_fault = time.time()
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        trial.fault_step = printed
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
            lines.poll()
        lines.poll()
        trial.code = proc.poll()
    finally:
        stop(proc)
    events = list(read_events(run))
    after = [e for e in events if e["time"] >= t_fault]
    kinds = {e["kind"] for e in after}
    trial.replaced = sum(e["kind"] == "rank_replaced" for e in events)
    reacted = min((e["time"] for e in after if e["kind"] in REACTIONS), default=t_fault)
    restarted = [e["time"] for e in after if e["kind"] == "workers_started"]
    if restarted:  # the group restarted: training again is its first step (not a survivor's last ones)
        reacted = max(restarted)
        trial.to_restart = reacted - t_fault
    again = [(t, s) for t, s in lines.lines if t > reacted]
    if again:
        trial.seconds = again[0][0] - t_fault
        trial.redone = max(0, printed - (again[0][1] - 1))
    reasons = [e["details"].get("reason") or e["details"].get("cause") or "" for e in after if e["kind"] in FALLBACKS]
    trial.reason = "; ".join(dict.fromkeys(str(r) for r in reasons if r))
    console = Path(f"{run}.log").read_bytes().decode(errors="replace")
    trial.console_reason = any(
        line.startswith("trainguard:") and "restart" in line and ("(" in line or ":" in line.split("trainguard:", 1)[1])
        for line in console.splitlines()
    )
    in_process_on = not any(s.startswith("recovery.in_process=false") for s in settings)
    if trial.code != 0:
        trial.path = "failed"
    elif not in_process_on:
        trial.path = "restart"
    elif kinds & FALLBACKS:
        trial.path = "fallback"
    else:
        trial.path = "in-process" if trial.replaced else "none"
    trial.bitwise = clean is not None and hash_of(Path(f"{run}.hash")) == clean
    return trial


def table(trials: list[Trial]) -> str:
    """A markdown table of trials: shape, fault, path, seconds, steps redone, bitwise, replacements."""
    out = [
        "| shape | fault | at step | path | fault → training again (s) | steps redone | bitwise | rank_replaced | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in trials:
        secs = f"{t.seconds:.2f}" if t.seconds == t.seconds else "-"
        out.append(
            f"| {t.shape} | {t.fault} | {t.fault_step} | {t.path} | {secs} | {t.redone if t.redone >= 0 else '-'} "
            f"| {'yes' if t.bitwise else 'no'} | {t.replaced} | {t.reason[:80]} |"
        )
    return "\n".join(out)


@dataclass
class Resume:
    """One resume arm's outcome (:func:`resume_trial`).

    Attributes:
        how: ``"sigterm"`` (the launcher told to stop: it saves and exits 75) or ``"kill"`` (the
            launcher's session SIGKILLed: the launch resumes from its newest checkpoint).
        at: rank 0's newest step line when the launch was stopped.
        first, second: the exit codes of the stopped launch and of the relaunch.
        from_step: the step the relaunch resumed from (``-1``: it did not say).
        bitwise: the relaunch's final weights equal the uninterrupted run's.
        said: the causes of the relaunch's ``resume_not_bitwise`` events (why it cannot be bitwise).
    """

    how: str
    at: int = 0
    first: Optional[int] = None
    second: Optional[int] = None
    from_step: int = -1
    bitwise: bool = False
    said: list = field(default_factory=list)


def resume_trial(shape: Shape, run: Path, seed: int, how: str, clean: Optional[str], timeout: float = 300) -> Resume:
    """Launch ``shape``, stop the whole launch at a seeded random step in ``[15, 45]`` (``how``, see
    :class:`Resume`), launch the same command again and let it finish; the first launch's log is
    kept as ``RUN.first.log``."""
    at = random.Random(seed).randint(15, 45)
    result = Resume(how)
    proc = launch(shape, run)
    lines = StepLines(Path(f"{run}.log"))
    deadline = time.monotonic() + timeout
    try:
        lines.wait_for(at, proc, deadline)
        result.at = lines.newest()
        if proc.poll() is None and how == "sigterm":
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        stop(proc)  # "kill": the launcher and its ranks at once
        result.first = proc.returncode
    finally:
        stop(proc)
    before = {e["time"] for e in read_events(run, "resume_not_bitwise")}
    os.replace(f"{run}.log", f"{run}.first.log")
    again = launch(shape, run)
    try:
        result.second = again.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(again)
    resumes = list(read_events(run, "resume"))
    result.from_step = int(resumes[-1]["details"]["from_step"]) if resumes else -1
    result.said = [e["details"]["cause"] for e in read_events(run, "resume_not_bitwise") if e["time"] not in before]
    result.bitwise = clean is not None and hash_of(Path(f"{run}.hash")) == clean
    return result


def kill_arms(
    names: list[str], arms: dict[str, tuple[str, ...]], base: Path, trials: int, steps: int, seed: int
) -> tuple[list[tuple[str, dict[str, list[Trial]]]], bool]:
    """For each shape of ``names``: its uninterrupted run, then ``trials`` seeded kills, each in
    every arm of ``arms`` (``{arm: settings}``) in turn, so the arms see the same kill and the
    same load; runs under ``base``. Returns ``([(shape, {arm: trials})], whether a launch failed)``
    (a shape whose uninterrupted run failed is left out, and said)."""
    rows, failed = [], False
    for n, name in enumerate(names):
        shape = SHAPES[name]
        clean = clean_run(shape, base / name / "clean", steps=steps)
        if clean is None:
            print(f"{name}: the uninterrupted run failed: {base / name / 'clean'}.log", flush=True)
            failed = True
            continue
        done: dict[str, list[Trial]] = {arm: [] for arm in arms}
        for i in range(trials):
            trial_seed = seed * 100_000 + n * 100 + i
            for arm, settings in arms.items():
                t = fault_trial(
                    shape, base / name / f"{arm}-{i}", trial_seed, settings=settings, clean=clean, steps=steps
                )
                done[arm].append(t)
                failed |= t.code != 0
        rows.append((name, done))
        print(f"{name}: done", flush=True)
    return rows, failed


def unknown_shapes(names: list[str]) -> list[str]:
    """The names of ``names`` that are no shape of :data:`SHAPES`."""
    return [s for s in names if s not in SHAPES]
