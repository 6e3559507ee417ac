"""Goodput under a fault schedule: in-process recovery against the group restart, same faults.

The example GPT (``examples/gpt.py``, its default size) trains on 2 CPU ranks under ``trainguard
run`` for ``--minutes`` (10; ``[stop] max_duration``, the launch then ends with 75 after a save)
while this script injects a fault every ``--every`` seconds (60): SIGKILL or SIGSTOP (a hang,
found by the hang supervisor) of a random rank, drawn from ``random.Random(--seed)``, so both arms
get the same schedule. The rank's current process is read from the launch record
(``RUN_DIR/.launches``), so a replacement can be the next victim. Two arms, one after the other:

* **in-process**: ``[recovery] in_process = true``, one warm spare;
* **restart**: ``[recovery] in_process = false``: today's group restart from the newest checkpoint.

For each arm, ``trainguard report --json`` gives the goodput (productive step time / wall time)
and the time lost per fault (restart overhead + redone work, over the faults injected). Goal of
the in-process arm: goodput ≥ 0.97 (ByteRobust reports 97 % effective training time at 9,600
GPUs; torchft 82 % step efficiency with a failure every 60 s).

    .venv/bin/python benchmarks/goodput_faults.py [--minutes 10] [--every 60] [--seed 0] [--faults kill,hang] [--smoke]

``--smoke``: 24 s per arm, one kill after 10 s, the tiny GPT: it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from _common import SMOKE_HELP
from _common import trainguard_cmd as _trainguard

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
ARMS = {"in-process": ["recovery.in_process=true", "launcher.spares=1"], "restart": ["recovery.in_process=false"]}
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=32", "train.batch_size=4"]
GOAL = 0.97


def schedule(args: argparse.Namespace) -> list[tuple[float, str, int]]:
    """``[(seconds after the launch, "kill" | "hang", rank)]``, the same for every arm."""
    rng = random.Random(args.seed)
    times = [args.every * k for k in range(1, int(args.minutes * 60 // args.every) + 1)]
    margin = min(20.0, args.minutes * 20)  # the last fault leaves time to recover before the time limit
    return [(t, rng.choice(args.faults), rng.randrange(2)) for t in times if t < args.minutes * 60 - margin]


def rank_pid(run_dir: Path, rank: int) -> Optional[int]:
    """The current process of local rank ``rank``, from the launch record (``None`` between groups)."""
    for path in (run_dir / ".launches").glob("*.json"):
        try:
            ranks = json.loads(path.read_text())["ranks"]
        except (OSError, ValueError, KeyError):
            continue
        if str(rank) in ranks:
            return int(ranks[str(rank)]["pid"])
    return None


def run_arm(args: argparse.Namespace, arm: str, run_dir: Path, faults: list[tuple[float, str, int]]) -> dict:
    """One launch with the fault schedule; returns the report's goodput, breakdown and faults injected."""
    sets = [
        f"stop.max_duration={args.minutes * 60:.0f}",
        "train.max_steps=100000000",
        "checkpoint.interval=50",  # about 20 s of the default GPT here: what a group restart falls back to
        "launcher.max_restarts=1000",  # a fault a minute is the schedule, not a reason to give up
        "supervisor.max_no_progress_restarts=1000",
        *(TINY if args.smoke else []),
        *ARMS[arm],
    ]
    cmd = _trainguard() + ["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(GPT)]
    cmd += [x for s in sets for x in ("--set", s)]
    log = open(f"{run_dir}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    injected = []
    try:
        for at, kind, rank in faults:
            while time.monotonic() - t0 < at and proc.poll() is None:
                time.sleep(0.1)
            pid = rank_pid(run_dir, rank)
            if proc.poll() is not None or pid is None:
                continue
            try:
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            except ProcessLookupError:
                continue
            injected.append((round(time.monotonic() - t0, 1), kind, rank))
            print(f"  {arm}: {kind} of rank {rank} (pid {pid}) at {injected[-1][0]:.0f} s", flush=True)
        code = proc.wait(timeout=args.minutes * 60 + 600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    report = subprocess.run(
        _trainguard() + ["report", str(run_dir), "--json"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    data = json.loads(report.stdout) if report.returncode == 0 else {}
    return {"code": code, "injected": injected, "report": data}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="training time per arm (default 10, smoke 0.4)")
    p.add_argument("--every", type=float, default=None, help="seconds between faults (default 60, smoke 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--faults", default=None, help="comma-separated kinds drawn from: kill,hang (default both, smoke kill)"
    )
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of in-process,restart")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    args = p.parse_args()
    args.minutes = args.minutes or (0.4 if args.smoke else 10.0)
    args.every = args.every or (10.0 if args.smoke else 60.0)
    args.faults = (args.faults or ("kill" if args.smoke else "kill,hang")).split(",")
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            p.error(f"unknown arm {a!r}")
    faults = schedule(args)
    print(f"fault schedule (s, kind, rank), seed {args.seed}: {faults}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="tg-bench-goodput-"))
    results = {}
    try:
        for arm in arms:
            results[arm] = run_arm(args, arm, base / arm, faults)
    finally:
        if args.keep:
            print(f"run directories kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print(
        f"\ngoodput of the example GPT on 2 CPU ranks, {args.minutes:g} min per arm, a fault every {args.every:g} s "
        f"({', '.join(args.faults)}, random rank, seed {args.seed})"
    )
    print(f"| {'arm':<10} | exit | faults | goodput | lost per fault (s) | steps trained again | / restart |")
    print(f"|{'-' * 12}|------|--------|---------|--------------------|---------------------|-----------|")
    base_goodput = results.get("restart", {}).get("report", {}).get("goodput")
    problems = []
    for arm, r in results.items():
        rep = r["report"]
        goodput = rep.get("goodput")
        parts = rep.get("time_breakdown", {})
        n = len(r["injected"])
        lost = (parts.get("restart_overhead", 0.0) + parts.get("redone_work", 0.0)) / n if n else 0.0
        recovered = rep.get("failure_recovery", {})  # the faults only (not the final time-limit stop)
        redone = sum(v.get("steps_lost") or 0 for v in recovered.values()) if recovered else "—"
        ratio = f"{goodput / base_goodput:.3f}" if goodput and base_goodput else "—"
        gp = f"{goodput:.3f}" if goodput is not None else "—"
        print(f"| {arm:<10} | {r['code']!s:>4} | {n:>6} | {gp:>7} | {lost:>18.2f} | {redone:>19} | {ratio:>9} |")
        if r["code"] not in (0, 75) or goodput is None:
            problems.append(f"{arm}: exit code {r['code']}, report {'ok' if rep else 'failed'}")
    if "in-process" in results and results["in-process"]["report"].get("goodput") is not None:
        g = results["in-process"]["report"]["goodput"]
        print(f"in-process goodput {g:.3f}: goal ≥ {GOAL}: {'met' if g >= GOAL else 'MISSED'}")
    if problems:
        print("failed: " + " | ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
