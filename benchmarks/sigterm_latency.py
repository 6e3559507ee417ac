"""Latency from SIGTERM to the exit of a ``trainguard run`` launch, split into phases.

Each repetition launches::

    trainguard run --nproc-per-node 2 --run-dir D examples/gpt.py \\
        --set train.max_steps=100000 --set checkpoint.interval=1000000 [--set model...]

waits until rank 0 prints its second ``step `` line (training is under way, ``--warm-steps``) plus a random fraction
of a step (so the signal lands anywhere in a step), sends SIGTERM to the launcher, waits for it to exit (expected code 75, requeue) and reads ``D/events.jsonl``:

* **forward**: SIGTERM sent → rank 0's Python handler ran (``stop_requested.details.signal_time``):
  the launcher forwards the signal, and CPython runs the handler only when the main thread is back
  in the interpreter, so this includes the rest of the torch op that was running (a backward can
  take most of a step);
* **finish step**: handler → ``stop_requested`` event (the rest of the step, then the Guard's stop
  check at the step boundary, where all ranks agree to stop);
* **save**: ``stop_requested`` → ``checkpoint_committed`` of the stop step;
* **rank exit**: ``checkpoint_committed`` → the ranks' ``exit`` event (rank 0, just before
  ``SystemExit``);
* **launcher exit**: ``exit`` event → the launcher process has exited, split into: rank teardown
  (until the last rank process has exited, polled in ``/proc``), agent notices (→ the agent's
  ``workers_failed`` event; it polls every ``launcher.monitor_interval``), agent shutdown
  (→ ``launch_exit``), launcher teardown (→ the launcher process is gone).

The medians over ``--reps`` runs are printed with the total and the save's share of it. There is no
external baseline: the save is the work that has to happen, everything else is overhead.

    .venv/bin/python benchmarks/sigterm_latency.py [--quick | --smoke] [--reps 3] [--model default|small|tiny] [--set k=v ...]
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

from _common import SMOKE_HELP  # noqa: E402
from _common import exited as _exited
from _common import run_events as _events
from _common import trainguard_cmd as _trainguard

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.d_model=128", "model.n_layers=2", "model.n_heads=4", "data.max_bytes=2000000"]
TINY = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.seq_len=32",
    "data.max_bytes=200000",
    "train.batch_size=2",
    "train.log_interval=1",
]
MODELS = {"default": [], "small": SMALL, "tiny": TINY}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one repetition with the small model, to check that it works")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    p.add_argument(
        "--smoke", action="store_true", help=SMOKE_HELP + " (one repetition, tiny model, a step log line every step)"
    )
    p.add_argument(
        "--model",
        choices=list(MODELS),
        default=None,
        help="examples/gpt.py's default model (3.3 M parameters), a small one or a tiny one (default: default, "
        "quick: small, smoke: tiny)",
    )
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra override for gpt.py (repeatable)")
    p.add_argument("--warm-steps", type=int, default=2, help="wait for this many 'step' log lines before SIGTERM")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each phase before giving up")
    args = p.parse_args()
    args.reps = args.reps or (1 if args.quick or args.smoke else 3)
    args.model = args.model or ("tiny" if args.smoke else "small" if args.quick else "default")
    return args


def _watch_exits(pids: list[int], out: dict[int, float], stop: threading.Event) -> None:
    """Record the time each rank process exits (polled every 2 ms)."""
    while not stop.is_set() and len(out) < len(pids):
        for pid in pids:
            if pid not in out and _exited(pid):
                out[pid] = time.time()
        time.sleep(0.002)


def one_run(args: argparse.Namespace, run_dir: Path, rng: random.Random) -> dict:
    sets = ["train.max_steps=100000", "checkpoint.interval=1000000", "train.log_interval=5"]
    sets += MODELS[args.model] + args.sets
    cmd = _trainguard() + ["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(ROOT / "examples" / "gpt.py")]
    for s in sets:
        cmd += ["--set", s]
    t_launch = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )  # our terminal's Ctrl-C must not reach it
    lines: list[str] = []
    ready = threading.Event()
    steps_seen = 0
    step_ms = [0.0]

    def reader() -> None:
        nonlocal steps_seen
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("step "):
                steps_seen += 1
                try:  # "step 5/100000 loss 4.97 lr 3.00e-04 390 ms/step"
                    step_ms[0] = float(line.split()[-2])
                except (ValueError, IndexError):
                    pass
                if steps_seen >= args.warm_steps:
                    ready.set()
        ready.set()  # EOF: the launch ended early

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    if not ready.wait(args.timeout) or proc.poll() is not None:
        proc.kill()
        raise RuntimeError("training did not start:\n" + "\n".join(lines[-30:]))
    t_ready = time.time()
    # the log line comes right after a step boundary: wait a random fraction of a step so that the
    # signal lands anywhere in a step, as a real preemption does
    delay = rng.uniform(0, step_ms[0] / 1e3)
    time.sleep(delay)
    started = [e for e in _events(run_dir) if e["kind"] == "workers_started"]
    pids = [int(p) for p in started[-1]["details"]["pids"].values()] if started else []
    rank_exits: dict[int, float] = {}
    watch_stop = threading.Event()
    watcher = threading.Thread(target=_watch_exits, args=(pids, rank_exits, watch_stop), daemon=True)
    watcher.start()
    t_sig = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("launcher did not exit after SIGTERM:\n" + "\n".join(lines[-30:])) from None
    t_exit = time.time()
    watch_stop.set()
    watcher.join(5)
    th.join(5)

    ev = _events(run_dir)
    stop = next(e for e in ev if e["kind"] == "stop_requested")
    commit = next((e for e in ev if e["kind"] == "checkpoint_committed" and e["step"] == stop["step"]), None)
    rank_exit = next((e for e in ev if e["kind"] == "exit" and e["rank"] == 0), None)
    launch_exit = next((e for e in ev if e["kind"] == "launch_exit"), None)
    noticed = next((e for e in ev if e["kind"] == "workers_failed"), None)
    if commit is None or rank_exit is None:
        raise RuntimeError(f"missing events (commit={commit}, exit={rank_exit}); output:\n" + "\n".join(lines[-30:]))
    handler = stop["details"].get("signal_time") or stop["time"]
    t_procs = max(rank_exits.values()) if pids and len(rank_exits) == len(pids) else None
    return {
        "code": code,
        "startup": t_ready - t_launch,
        "forward": handler - t_sig,
        "finish_step": stop["time"] - handler,
        "to_stop": stop["time"] - t_sig,
        "save": commit["time"] - stop["time"],
        "save_inner": commit["details"].get("seconds"),
        "bytes": commit["details"].get("bytes"),
        "rank_exit": rank_exit["time"] - commit["time"],
        "after_exit_event": t_exit - rank_exit["time"],
        # rank exit event -> the last rank process has exited (interpreter and process-group teardown)
        "rank_teardown": (t_procs - rank_exit["time"]) if t_procs else None,
        # -> the agent noticed (workers_failed event; its monitor loop polls every monitor_interval)
        "agent_notice": (noticed["time"] - t_procs) if (noticed and t_procs) else None,
        # -> launch_exit event (stop workers, rendezvous shutdown)
        "agent_shutdown": (launch_exit["time"] - noticed["time"]) if (launch_exit and noticed) else None,
        # -> the launcher process has exited (interpreter teardown)
        "launcher_teardown": (t_exit - launch_exit["time"]) if launch_exit else None,
        "total": t_exit - t_sig,
        "stop_step": stop["step"],
        "step_ms": step_ms[0],
        "delay": delay,
    }


def main() -> int:
    args = _parse()
    from rich.console import Console
    from rich.table import Table

    base = Path(tempfile.mkdtemp(prefix="tg-bench-sigterm-"))
    runs = []
    rng = random.Random(0)
    t_wall = time.perf_counter()
    try:
        for i in range(args.reps):
            runs.append(one_run(args, base / f"run-{i}", rng))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t_wall

    med = statistics.median
    total = med(r["total"] for r in runs)
    table = Table(
        title=f"SIGTERM → exit of `trainguard run --nproc-per-node 2 examples/gpt.py` ({args.model} model), "
        f"median of {len(runs)} run(s)"
    )
    table.add_column("phase")
    table.add_column("from → to")
    table.add_column("median ms", justify="right")
    table.add_column("runs (ms)", justify="right")
    table.add_column("share", justify="right")

    def row(name: str, span: str, key: str) -> None:
        vals = [r[key] for r in runs if r[key] is not None]
        if not vals:
            return
        m = med(vals)
        table.add_row(name, span, f"{m * 1e3:.0f}", " ".join(f"{v * 1e3:.0f}" for v in vals), f"{m / total * 100:.0f}%")

    row("forward", "SIGTERM sent → rank 0 Python handler ran", "forward")
    row("finish step", "handler → stop_requested", "finish_step")
    row("  = signal to stop", "SIGTERM sent → stop_requested", "to_stop")
    row("save", "stop_requested → checkpoint_committed", "save")
    row("rank exit", "checkpoint_committed → rank exit event", "rank_exit")
    row("launcher exit", "rank exit event → launcher process exited", "after_exit_event")
    row("  rank teardown", "rank exit event → last rank process gone", "rank_teardown")
    row("  agent notices", "→ workers_failed event (monitor poll)", "agent_notice")
    row("  agent shutdown", "→ launch_exit event", "agent_shutdown")
    row("  launcher teardown", "→ launcher process exited", "launcher_teardown")
    row("total", "SIGTERM sent → launcher process exited", "total")
    Console(width=140).print(table)
    codes = [r["code"] for r in runs]
    saves = [r["save_inner"] for r in runs if r["save_inner"] is not None]
    print(
        f"exit codes {codes} (expected 75 each); checkpoint {runs[0]['bytes']:,} bytes, save_state's own "
        f"time {med(saves) * 1e3:.0f} ms median; save share of total {med(r['save'] for r in runs) / total * 100:.0f}%"
    )
    delays = " ".join(f"{r['delay'] * 1e3:.0f}" for r in runs)
    print(
        f"step time (rank 0 log) {med(r['step_ms'] for r in runs):.0f} ms; SIGTERM sent {delays} ms after a step log line"
    )
    print(
        f"launch to step line #{args.warm_steps} {med(r['startup'] for r in runs):.1f} s; stop steps {[r['stop_step'] for r in runs]}; "
        f"wall {wall:.1f} s; load average {os.getloadavg()[0]:.2f} (other processes on this machine add noise)"
    )
    if any(c != 75 for c in codes):
        print("WARNING: a launch did not exit with 75 (requeue)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
