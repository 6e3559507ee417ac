#!/usr/bin/env python
"""Checkpoint crash torture test: SIGKILL a training process at random moments, check the store.

Usage::

    python scripts/ckpt_torture.py --trials 1000 [--seed S] [--workdir D] [--jobs J] [--mode exec|fork]

A *trial* is one SIGKILL. Trials are grouped in trial directories: in each one a writer process
trains a small MLP with :class:`trainguard.Guard` (a checkpoint every step, ``keep_last=2``), is
SIGKILLed at a random moment, resumed and SIGKILLed again (``--kills-per-dir`` times), and finally
resumed and run to the end without a kill.

After every kill the store must satisfy the checkpoint invariants:

* every ``step-*`` directory verifies against its manifest (``manifest.verify``) and holds no file
  the manifest does not list; nothing partial is ever visible;
* ``CheckpointStore.latest_valid()`` returns a checkpoint (once any ``checkpoint_committed`` event
  was written) that verifies, and it is not older than the newest committed event: retention never
  removed the newest checkpoint;
* the next incarnation starts at exactly that step (its ``start`` event's ``first_step``).

At the end of a trial directory the final ``end`` event's ``state_sha256`` must equal that of a clean,
uninterrupted reference run, exactly ``keep_last`` checkpoints remain and no ``.tmp-``/``.trash-``
directory is left.

Kill timing: most kills wait until the incarnation has committed two checkpoints (which measures
the current step+save period P under the current machine load), then sleep ``uniform(0, P)``; saves
are most of a step, so most kills land while a checkpoint is being written (counted by a
``.tmp-step-*`` directory left behind). A fraction (``--early-fraction``) is killed at a uniform
moment during start-up and resume instead.

Writer processes: ``--mode exec`` starts each one as ``sys.executable THIS --child DIR``;
``--mode fork`` (default) keeps one "fork server" per job (``sys.executable THIS --server``, torch
imported once) which ``os.fork()``s each writer, so a kill costs a fraction of a second instead of
the ~3 s interpreter and torch start-up. Either way the writer is a real process running the same
``--child`` code, killed with a real SIGKILL, writing real files.

Self-test: ``--inject partial-dir|early-retention|lost-data-position`` plants a known bug in the
killed writers (not in the reference run); the torture must then fail.

Prints one ``SUMMARY trials=N kills=N during_save=K (P%) ... failures=F elapsed=Ts`` line at the end;
exits 1 on any failure (failed trial directories are kept under the workdir for inspection), 0
otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

THIS = Path(__file__).resolve()

# ---------------------------------------------------------------------------------------------
# the writer (child) side


MODEL_DEFAULTS = {"in_dim": 256, "hidden": 512, "out_dim": 256}
N_SAMPLES = 512
BATCH = 8
KEEP_LAST = 2


def build_model(in_dim: int, hidden: int, out_dim: int):
    """The writer's model: keys 0.weight/0.bias, 3.*, 5.* (0.53 M parameters, ~6 MB per checkpoint with AdamW state)."""
    import torch.nn as nn

    return nn.Sequential(
        nn.Linear(in_dim, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),  # dropout: the RNG state must resume too
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, out_dim),
    )


INJECTABLE = ("partial-dir", "early-retention", "lost-data-position")


def inject_bug(kind: str) -> None:
    """Self-test of the torture: plant a known bug in this writer's checkpoint store.

    ``partial-dir``: write straight into ``step-N`` (no temporary directory, no atomic rename), so a
    kill during a save leaves a partial committed checkpoint (breaks invariant 1).
    ``early-retention``: delete every committed checkpoint before writing the new one (breaks
    invariant 2).
    ``lost-data-position``: the sampler is not handed to the Guard, so a resume restarts the data
    order (the final state hash must differ from the reference).
    """
    import shutil as _shutil

    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint.store import Checkpoint, CheckpointStore

    if kind == "partial-dir":

        def begin(self, step):
            self.root.mkdir(parents=True, exist_ok=True)
            path = self.path_for(step)
            _shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            return path

        def commit(self, tmp, step, files, meta):
            mf.write_manifest(tmp, step, files, meta)
            return Checkpoint(step, tmp)

        CheckpointStore.tmp_path_for = CheckpointStore.path_for
        CheckpointStore.begin, CheckpointStore.commit = begin, commit
    elif kind == "lost-data-position":
        pass  # handled in child_main
    elif kind == "early-retention":
        original_begin = CheckpointStore.begin

        def begin(self, step):
            for c in self.committed():
                _shutil.rmtree(c.path)
            return original_begin(self, step)

        CheckpointStore.begin = begin
    else:
        raise ValueError(f"unknown bug {kind!r}; choose from {INJECTABLE}")


def child_main(
    run_dir: str,
    max_steps: int,
    in_dim: int,
    hidden: int,
    out_dim: int,
    inject: Optional[str] = None,
    sets: tuple[str, ...] = (),
) -> int:
    """Train the MLP under a Guard in ``run_dir``; returns the exit code (SystemExit from the Guard passes)."""
    import torch
    import torch.nn.functional as F

    import trainguard

    if inject:
        inject_bug(inject)
    torch.set_num_threads(1)
    from trainguard.outcomes import exit_bad_input

    try:
        cfg = trainguard.load_config(
            None,
            [
                f"run.dir={run_dir}",
                "checkpoint.interval=1",
                "instability.known_good_after=1",
                f"checkpoint.keep_last={KEEP_LAST}",
                *sets,
            ],
        )
    except trainguard.ConfigError as e:
        exit_bad_input(str(e))
    trainguard.seed_everything(0)
    g = torch.Generator().manual_seed(1234)  # fixed data, independent of the global RNG
    xs = torch.randn(N_SAMPLES, in_dim, generator=g)
    ys = torch.randn(N_SAMPLES, out_dim, generator=g)
    model = build_model(in_dim, hidden, out_dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    sampler = trainguard.ResumableSampler(N_SAMPLES, seed=0)
    guard = trainguard.Guard(
        cfg, model=model, optimizer=opt, scheduler=sched, sampler=None if inject == "lost-data-position" else sampler
    )
    for _ in guard.steps(max_steps):
        idx = sampler.take(BATCH)
        loss = F.mse_loss(model(xs[idx]), ys[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        guard.step_end(loss=loss)
    return 0


def _child_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ckpt_torture.py --child")
    p.add_argument("--child", required=True, metavar="DIR")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--in-dim", type=int, default=MODEL_DEFAULTS["in_dim"])
    p.add_argument("--hidden", type=int, default=MODEL_DEFAULTS["hidden"])
    p.add_argument("--out-dim", type=int, default=MODEL_DEFAULTS["out_dim"])
    p.add_argument("--inject", choices=INJECTABLE, default=None)
    p.add_argument("--set", action="append", default=[], help="config override for the Guard")
    return p.parse_args(argv)


def run_child(argv: list[str]) -> int:
    a = _child_args(argv)
    return child_main(a.child, a.max_steps, a.in_dim, a.hidden, a.out_dim, a.inject, tuple(a.set))


def tier_sets(async_save: bool, local: bool, run_dir: str = "{run_dir}") -> list[str]:
    """Config overrides of the ``--async-save`` and ``--local`` modes (the local tier lives in the
    trial's own directory, ``RUN_DIR/local``, standing in for a node-local disk)."""
    sets = [f"checkpoint.async_save={str(async_save).lower()}"]  # without --async-save: synchronous saves
    if local:
        sets += [f"checkpoint.local.dir={run_dir}/local", "checkpoint.local.interval=1", "checkpoint.interval=3"]
    return sets


def server_main() -> int:
    """Fork server: import torch and trainguard once, then fork one writer per request.

    Protocol: one JSON object per line on stdin, one reply line on stdout. The server first prints
    ``ready``; then ``{"cmd": "spawn", "log": LOGFILE, "args": [...]}`` -> ``pid N`` (the writer runs
    ``--child`` with ``args``, stdout and stderr to LOGFILE); ``{"cmd": "wait", "pid": N}`` ->
    ``exit N CODE`` (CODE negative for a signal, like ``Popen.returncode``); ``{"cmd": "ping"}`` ->
    ``pong``; ``{"cmd": "quit"}`` ends the server.
    """
    import torch  # noqa: F401  (the point of the server: import once, before any fork)
    import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer: ~0.8 s)
    import torch.distributed.checkpoint  # noqa: F401

    import trainguard  # noqa: F401

    print("ready", flush=True)

    out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "spawn":
            log, args = req["log"], req["args"]
            out.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the writer
                code = 1
                try:
                    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                    code = run_child(args)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            print(f"pid {pid}", file=out, flush=True)
        elif cmd == "wait":
            pid = int(req["pid"])
            _, status = os.waitpid(pid, 0)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(f"exit {pid} {code}", file=out, flush=True)
        elif cmd == "ping":
            print("pong", file=out, flush=True)
        elif cmd == "quit":
            break
    return 0


# ---------------------------------------------------------------------------------------------
# the torture (parent) side


class Writer:
    """A running writer process: started either by exec or through a fork server."""

    def __init__(self, pid: int, proc: Optional[subprocess.Popen] = None, server: Optional[ForkServer] = None):
        self.pid, self._proc, self._server = pid, proc, server
        self.returncode: Optional[int] = None

    def kill(self) -> None:
        # the writer is not reaped before wait(), so its pid cannot have been reused
        os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if self._proc is not None:
                self.returncode = self._proc.wait(timeout=timeout)
            else:
                self.returncode = self._server.wait(self.pid)
        return self.returncode

    def alive(self) -> bool:
        """True while the process exists and has not exited (a zombie counts as exited)."""
        if self.returncode is not None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False


class ForkServer:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, str(THIS), "--server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.ready = False  # servers start (import torch) in parallel; wait for one on first use

    def _ask(self, **request) -> list[str]:
        if not self.ready:
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"fork server failed to start (exit code {self.proc.wait()})")
            self.ready = True
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"fork server died (exit code {self.proc.poll()})")
        return reply.split()

    def spawn(self, log: Path, args: list[str]) -> Writer:
        kind, pid = self._ask(cmd="spawn", log=str(log), args=args)
        return Writer(int(pid), server=self)

    def wait(self, pid: int) -> int:
        _, _, code = self._ask(cmd="wait", pid=pid)
        return int(code)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class Launcher:
    """Starts writers in one mode; one per job thread (a fork server is not shared)."""

    def __init__(
        self,
        mode: str,
        max_steps: int,
        hidden: int = MODEL_DEFAULTS["hidden"],
        inject: Optional[str] = None,
        sets: tuple[str, ...] = (),
    ):
        self.mode, self.max_steps, self.hidden, self.inject, self.sets = mode, max_steps, hidden, inject, sets
        self.server = ForkServer() if mode == "fork" else None

    def start(self, run_dir: Path) -> Writer:
        args = ["--child", str(run_dir), "--max-steps", str(self.max_steps), "--hidden", str(self.hidden)]
        if self.inject:
            args += ["--inject", self.inject]
        for item in self.sets:
            args += ["--set", item.replace("{run_dir}", str(run_dir))]
        log = Path(f"{run_dir}.log")
        if self.server is not None:
            return self.server.spawn(log, args)
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                [sys.executable, str(THIS), *args], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        return Writer(proc.pid, proc=proc)

    def warm(self) -> None:
        """Wait until writers can be started (the fork server has imported torch)."""
        if self.server is not None:
            self.server._ask(cmd="ping")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class EventTail:
    """Reads the events a writer appends to ``run_dir/events.jsonl`` from a given offset on."""

    def __init__(self, run_dir: Path, pid: Optional[int] = None, offset: Optional[int] = None):
        self.path = run_dir / "events.jsonl"
        self.pid = pid
        self.offset = offset if offset is not None else self.size()
        self._partial = b""

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        out = []
        for line in lines:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if self.pid is None or ev.get("pid") == self.pid:
                out.append(ev)
        return out


def read_all_events(run_dir: Path) -> list[dict]:
    return EventTail(run_dir, offset=0).new()


@dataclass
class Stats:
    kills: int = 0
    during_save: int = 0  # a .tmp-step-* directory was left behind
    during_delete: int = 0  # a .trash-* directory was left behind (killed inside retention)
    early: int = 0  # killed during start-up/resume (before its first save of this incarnation)
    no_ckpt_yet: int = 0  # killed before the trial directory had any checkpoint
    dirs: int = 0
    dirs_ok: int = 0
    finished_early: int = 0  # a writer reached max_steps before its kill (no kill counted)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def fail(self, where: str, message: str) -> None:
        with self.lock:
            self.failures.append(f"{where}: {message}")
        print(f"FAIL {where}: {message}", flush=True)


def check_store(run_dir: Path) -> tuple[list[str], Optional[int], dict[str, bool]]:
    """Check the checkpoint invariants in a run dir nobody is writing to.

    Returns (problems, step of latest_valid() or None, {"tmp": .tmp-step-* present, "trash": ...}).
    """
    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint.store import CheckpointStore

    problems: list[str] = []
    root = run_dir / "checkpoints"
    store = CheckpointStore(root, keep_last=KEEP_LAST)
    leftovers = {"tmp": False, "trash": False}
    # the persistent store, and with --local the local tier and its replicas: a kill during any save counts
    for d in [root, *(run_dir / "local").glob("*/rank-00000"), root / "local-replicas" / "rank-00000"]:
        if not d.is_dir():
            continue
        for p in d.iterdir():
            leftovers["tmp"] |= p.name.startswith(".tmp-step-")
            leftovers["trash"] |= p.name.startswith(".trash-")
    for c in store.committed():
        reason = mf.verify(c.path)
        if reason is not None:
            problems.append(f"{c.path.name} is committed but does not verify: {reason}")
            continue
        body = mf.read_manifest(c.path)
        if body["step"] != c.step:
            problems.append(f"{c.path.name}: manifest says step {body['step']}")
        extra = sorted({p.name for p in c.path.iterdir()} - set(body["files"]) - {mf.MANIFEST})
        if extra:
            problems.append(f"{c.path.name}: files not in the manifest: {extra}")
    best = store.latest_valid()
    committed_events = [e["details"]["path"] for e in read_all_events(run_dir) if e["kind"] == "checkpoint_committed"]
    newest_event = max((int(Path(p).name.split("-")[1]) for p in committed_events), default=None)
    if best is not None:
        reason = mf.verify(best.path)
        if reason is not None:
            problems.append(f"latest_valid() returned {best.path.name}, which does not verify: {reason}")
        missing = [n for n in mf.read_manifest(best.path)["files"] if not (best.path / n).is_file()]
        if missing:
            problems.append(f"latest_valid() returned {best.path.name} with missing files {missing}")
    if newest_event is not None and (best is None or best.step < newest_event):
        problems.append(
            f"checkpoint of step {newest_event} was committed (event), but latest_valid() is "
            f"{best.path.name if best else None}"
        )
    resume = best.step if best else None
    local = newest_local(run_dir, problems)
    if local is not None and (resume is None or local > resume):
        resume = local
    return problems, resume, leftovers


def newest_local(run_dir: Path, problems: list[str]) -> Optional[int]:
    """The newest local-tier step that verifies (own copy or its replica in the persistent tier);
    every committed local copy must verify (appends to ``problems`` otherwise)."""
    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint.store import CheckpointStore

    steps = set()
    for root in [*(run_dir / "local").glob("*/rank-00000"), run_dir / "checkpoints" / "local-replicas" / "rank-00000"]:
        for c in CheckpointStore(root).committed():
            reason = mf.verify(c.path)
            if reason is not None:
                problems.append(f"local copy {c.path} is committed but does not verify: {reason}")
            else:
                steps.add(c.step)
    return max(steps, default=None)


def wait_events(tail: EventTail, writer: Writer, until, timeout: float) -> tuple[Optional[list[dict]], list[dict]]:
    """Poll ``tail`` until ``until(events_so_far)`` is true; (None, events) if the writer exits or on timeout."""
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += tail.new()
        if until(seen):
            return seen, seen
        if not writer.alive():
            seen += tail.new()
            return (seen if until(seen) else None), seen
        time.sleep(0.002)
    return None, seen


def log_tail(run_dir: Path, n: int = 2500) -> str:
    try:
        return Path(f"{run_dir}.log").read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return "(no log)"


def reference_run(launcher: Launcher, workdir: Path, timeout: float) -> dict:
    """An uninterrupted run; returns its final hash and timings (start-up, step+save period)."""
    run_dir = workdir / "reference"
    launcher.warm()
    t0 = time.time()
    w = launcher.start(run_dir)
    code = w.wait(timeout=timeout)
    if code != 0:
        raise SystemExit(f"reference run failed with exit code {code}:\n{log_tail(run_dir)}")
    evs = read_all_events(run_dir)
    ends = [e for e in evs if e["kind"] == "end"]
    commits = [e["time"] for e in evs if e["kind"] == "checkpoint_committed"]
    saves = [e["details"]["seconds"] for e in evs if e["kind"] == "checkpoint_committed"]
    period = statistics.median(b - a for a, b in zip(commits, commits[1:]))
    return {
        "sha": ends[-1]["details"]["state_sha256"],
        "startup": commits[0] - t0,
        "period": period,
        "save": statistics.median(saves),
        "steps": len(commits),
    }


def run_trial_dir(
    tid: int, args: argparse.Namespace, launcher: Launcher, ref: dict, stats: Stats, budget: KillBudget
) -> None:
    rng = random.Random(f"{args.seed}-{tid}")
    run_dir = Path(args.workdir) / f"trial-{tid:05d}"
    name = run_dir.name
    ok = True
    expected_first = 0  # the step the next incarnation must start at
    kills_here = 0
    while kills_here < args.kills_per_dir and (expected_first or 0) < args.max_steps - 6 and budget.take():
        tail = EventTail(run_dir)
        w = launcher.start(run_dir)
        tail.pid = w.pid
        early = rng.random() < args.early_fraction
        try:
            if early:
                time.sleep(rng.uniform(0, ref["startup"] * 1.2))
                got, seen = [], tail.new()
            else:
                got, seen = wait_events(
                    tail, w, lambda evs: sum(e["kind"] == "checkpoint_committed" for e in evs) >= 2, args.timeout
                )
                if got is not None:
                    t1, t2 = [e["time"] for e in got if e["kind"] == "checkpoint_committed"][:2]
                    time.sleep(rng.uniform(0, max(t2 - t1, 0.005)))
            alive = w.alive()
            if alive:
                w.kill()
            code = w.wait(timeout=args.timeout)
        except BaseException:
            if w.alive():
                w.kill()
                w.wait()
            raise
        seen += tail.new()
        if not alive:
            budget.give_back()
            if code == 0:
                stats.add(finished_early=1)
                expected_first = check_store(run_dir)[1] or 0  # the finished run's final checkpoint
                break
            stats.fail(name, f"writer exited by itself with code {code} before its kill:\n{log_tail(run_dir)}")
            ok = False
            break
        elif got is None and not early:
            stats.fail(
                name, f"writer pid {w.pid} wrote no two checkpoints within {args.timeout} s:\n{log_tail(run_dir)}"
            )
            ok = False
            break
        kills_here += 1
        starts = [e for e in seen if e["kind"] == "start"]
        if starts and starts[0]["details"]["first_step"] != expected_first:
            stats.fail(
                name,
                f"incarnation pid {w.pid} started at step {starts[0]['details']['first_step']}, "
                f"latest_valid() was step {expected_first}",
            )
            ok = False
        problems, best, left = check_store(run_dir)
        stats.add(
            kills=1,
            during_save=int(left["tmp"]),
            during_delete=int(left["trash"]),
            early=int(early),
            no_ckpt_yet=int(best is None),
        )
        for p in problems:
            stats.fail(name, f"after kill {kills_here} (pid {w.pid}): {p}")
            ok = False
        if not ok:
            break
        expected_first = best or 0
        n = budget.done()
        if n % args.progress == 0:
            with stats.lock:
                print(
                    f"[{n}/{args.trials}] kills, {stats.during_save} during a save, {len(stats.failures)} failures",
                    flush=True,
                )
    if kills_here == 0 and ok:
        shutil.rmtree(run_dir, ignore_errors=True)
        Path(f"{run_dir}.log").unlink(missing_ok=True)
        return
    stats.add(dirs=1)
    if ok:  # resume to the end, uninterrupted
        tail = EventTail(run_dir)
        w = launcher.start(run_dir)
        tail.pid = w.pid
        code = w.wait(timeout=args.timeout * 3)
        evs = tail.new()
        ends = [e for e in evs if e["kind"] == "end"]
        starts = [e for e in evs if e["kind"] == "start"]
        if code != 0 or not ends:
            stats.fail(name, f"final resume exited with code {code} (end event: {bool(ends)}):\n{log_tail(run_dir)}")
            ok = False
        else:
            if starts and starts[0]["details"]["first_step"] != expected_first:
                stats.fail(
                    name,
                    f"final resume started at step {starts[0]['details']['first_step']}, "
                    f"latest_valid() was step {expected_first}",
                )
                ok = False
            sha = ends[-1]["details"]["state_sha256"]
            if sha != ref["sha"]:
                stats.fail(
                    name,
                    f"final state_sha256 {sha[:16]}... differs from the reference {ref['sha'][:16]}... "
                    f"(resumed from step {expected_first})",
                )
                ok = False
            problems, best, left = check_store(run_dir)
            from trainguard.checkpoint.store import CheckpointStore

            steps = [c.step for c in CheckpointStore(run_dir / "checkpoints").committed()]
            if not args.local and steps != list(range(args.max_steps - KEEP_LAST + 1, args.max_steps + 1)):
                problems.append(f"after the final run the committed steps are {steps}, expected the last {KEEP_LAST}")
            if left["tmp"] or left["trash"]:
                problems.append(
                    f"after the final run leftovers remain: {sorted(p.name for p in (run_dir / 'checkpoints').iterdir())}"
                )
            for p in problems:
                stats.fail(name, f"after the final run: {p}")
                ok = False
    if ok:
        stats.add(dirs_ok=1)
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
            Path(f"{run_dir}.log").unlink(missing_ok=True)


class KillBudget:
    """Hands out the ``--trials`` kills to the job threads."""

    def __init__(self, total: int):
        self.total, self.claimed, self.completed = total, 0, 0
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.claimed >= self.total:
                return False
            self.claimed += 1
            return True

    def give_back(self) -> None:
        with self.lock:
            self.claimed -= 1

    def done(self) -> int:
        with self.lock:
            self.completed += 1
            return self.completed

    def exhausted(self) -> bool:
        with self.lock:
            return self.claimed >= self.total


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=1000, help="number of SIGKILLs (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (timings still vary)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where trial directories go (default: a new temp dir, removed on success)",
    )
    p.add_argument(
        "--kills-per-dir", type=int, default=5, help="kill-resume-kill cycles per trial directory (default 5)"
    )
    p.add_argument("--max-steps", type=int, default=30, help="steps of a full run (default 30)")
    p.add_argument(
        "--hidden",
        type=int,
        default=MODEL_DEFAULTS["hidden"],
        help=f"hidden width of the MLP (default {MODEL_DEFAULTS['hidden']}: ~6 MB per checkpoint with AdamW state)",
    )
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="trial directories in parallel")
    p.add_argument(
        "--mode",
        choices=["exec", "fork"],
        default="fork",
        help="fork writers from a warm server (fork, default: ~0.3 s per kill) or start each as a new "
        "interpreter (exec: ~3 s per kill, for torch import)",
    )
    p.add_argument(
        "--early-fraction", type=float, default=0.1, help="share of kills during start-up/resume (default 0.1)"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a writer may take to reach its kill point")
    p.add_argument("--progress", type=int, default=50, help="print progress every N kills")
    p.add_argument("--keep", action="store_true", help="keep the trial directories that passed")
    p.add_argument(
        "--inject",
        choices=INJECTABLE,
        default=None,
        help="self-test: plant this bug in the killed writers (not the reference run); the torture must fail",
    )
    p.add_argument("--async-save", action="store_true", help="the writers save asynchronously (checkpoint.async_save)")
    p.add_argument(
        "--local",
        action="store_true",
        help="the writers also save to a local tier every step (persistent every 3 steps), replicated",
    )
    args = p.parse_args(argv)
    if args.max_steps < 10:
        p.error("--max-steps must be at least 10")

    own_workdir = args.workdir is None
    args.workdir = Path(tempfile.mkdtemp(prefix="ckpt-torture-")) if own_workdir else args.workdir
    args.workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    print(
        f"ckpt_torture: {args.trials} kills, {args.kills_per_dir} per trial dir, {args.jobs} jobs, mode {args.mode}, "
        f"seed {args.seed}, async_save {args.async_save}, local tier {args.local}, workdir {args.workdir}",
        flush=True,
    )

    import trainguard  # noqa: F401  (the checks need it; import it before the clock matters)

    sets = tuple(tier_sets(args.async_save, args.local))
    launcher = Launcher(args.mode, args.max_steps, args.hidden, sets=sets)
    job_launchers = [Launcher(args.mode, args.max_steps, args.hidden, args.inject, sets) for _ in range(args.jobs)]
    try:
        ref = reference_run(launcher, args.workdir, args.timeout * 3)
    except BaseException:
        for each in job_launchers:
            each.close()
        raise
    finally:
        launcher.close()
    print(
        f"reference: state_sha256 {ref['sha'][:16]}..., start-up {ref['startup']:.2f} s, step+save period "
        f"{ref['period'] * 1000:.0f} ms, save {ref['save'] * 1000:.0f} ms",
        flush=True,
    )

    stats = Stats()
    budget = KillBudget(args.trials)
    next_tid = iter(range(10**9))
    tid_lock = threading.Lock()

    def job(launcher: Launcher) -> None:
        try:
            while not budget.exhausted():
                with tid_lock:
                    tid = next(next_tid)
                run_trial_dir(tid, args, launcher, ref, stats, budget)
                with stats.lock:
                    if len(stats.failures) >= 20:
                        break
        except BaseException:
            stats.fail("job", traceback.format_exc())
        finally:
            launcher.close()

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for f in [pool.submit(job, each) for each in job_launchers]:
            f.result()

    elapsed = time.monotonic() - t_start
    pct = 100.0 * stats.during_save / stats.kills if stats.kills else 0.0
    if stats.kills < args.trials and not stats.failures:
        stats.fail("summary", f"only {stats.kills} of {args.trials} kills were made")
    print(
        f"SUMMARY trials={stats.kills} kills={stats.kills} during_save={stats.during_save} ({pct:.1f}%) "
        f"during_retention={stats.during_delete} early={stats.early} no_checkpoint_yet={stats.no_ckpt_yet} "
        f"trial_dirs={stats.dirs} dirs_ok={stats.dirs_ok} finished_before_kill={stats.finished_early} "
        f"failures={len(stats.failures)} elapsed={elapsed:.1f}s",
        flush=True,
    )
    if stats.failures:
        print(f"failed trial directories are kept under {args.workdir}", flush=True)
        return 1
    if own_workdir:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(run_child(sys.argv[1:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--server":
        sys.exit(server_main())
    sys.exit(main())
