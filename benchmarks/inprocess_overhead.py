"""Steady-state cost of in-process recovery: the per-step boundary state and the waiting spare.

The job of ``benchmarks/recovery_compare.py`` (``_recovery_worker.py --guard-api``: 2 gloo DDP
ranks, an MLP, steps padded to ``--step-ms`` = 30 ms before ``guard.step_end``, so what the Guard
does at the step boundary is not hidden by the padding), without a fault, under ``trainguard run``
two ways, trials interleaved:

* **off**: ``[recovery] in_process = false`` (no boundary state, no spare);
* **on**: ``[recovery] in_process = true`` with one warm spare: every step boundary keeps the rank's
  own state (RNG, data position, ...) in memory and in ``/dev/shm``, and the spare waits beside the
  ranks in the script's ``init_process_group``.

Step time = rank 0's ``mark`` event (after step ``--steps`` / 3, once start-up, including the
spare's, is over) → its ``end`` event, per step. Overhead = median on / median off − 1 (goal ≤ 1 %).
The kill and hang recoveries themselves are timed by ``recovery_compare.py``.

``--ranks 4`` runs 4 ranks (on 2 cores each rank shares its core with another).

    .venv/bin/python benchmarks/inprocess_overhead.py [--trials 6] [--steps 300] [--step-ms MS] [--ranks N] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from _common import SMOKE_HELP
from _common import run_events as _events
from _common import trainguard_cmd as _trainguard

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "_recovery_worker.py"
CONFIGS = {
    "off": ["recovery.in_process=false"],
    "on, warm spare": ["recovery.in_process=true", "launcher.spares=1"],
    "on, no spare": ["recovery.in_process=true", "launcher.spares=0"],
}
GOAL = 0.01  # the overhead goal: ≤ 1 % of the step time


def step_time(args: argparse.Namespace, name: str, run_dir: Path) -> Optional[float]:
    """Seconds per step of rank 0 from the ``mark`` to the ``end`` event; ``None`` if the run failed."""
    cmd = _trainguard() + [
        "run",
        "--nproc-per-node",
        str(args.ranks),
        "--run-dir",
        str(run_dir),
        str(WORKER),
        "--mode",
        "trainguard",
        "--guard-api",
        "--steps",
        str(args.steps),
        "--step-ms",
        str(args.step_ms),
        "--mark-step",
        str(args.steps // 3),
        *[x for s in [f"checkpoint.interval={args.ckpt_every}", *CONFIGS[name]] for x in ("--set", s)],
    ]
    code = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600).returncode
    ev = _events(run_dir)
    mark = next((e for e in ev if e["kind"] == "mark" and e["rank"] == 0), None)
    end = next((e for e in ev if e["kind"] == "end" and e["rank"] == 0), None)
    if code != 0 or mark is None or end is None:
        return None
    return (end["time"] - mark["time"]) / (end["step"] - mark["step"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=None, help="runs per configuration (default 6, smoke 1)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--step-ms", type=float, default=None, help="pad every step to this (default 30, smoke 10)")
    p.add_argument("--steps", type=int, default=None, help="steps of the job (default 300, smoke 60)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the job (default 2)")
    args = p.parse_args()
    args.trials = args.trials or (1 if args.smoke else 6)
    args.step_ms = args.step_ms or (10.0 if args.smoke else 30.0)
    args.steps = args.steps or (60 if args.smoke else 300)
    base = Path(tempfile.mkdtemp(prefix="tg-bench-inprocess-"))
    load0 = os.getloadavg()[0]
    times: dict[str, list[Optional[float]]] = {n: [] for n in CONFIGS}
    try:
        for t in range(args.trials):
            for name in CONFIGS:
                st = step_time(args, name, base / f"{name.replace(', ', '-').replace(' ', '-')}-{t}")
                times[name].append(st)
                print(f"trial {t + 1}/{args.trials} {name:>14}: {st and st * 1e3:.3f} ms/step", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    ok = {n: [x * 1e3 for x in v if x is not None] for n, v in times.items()}
    print(
        f"\nsteady-state step time with in-process recovery (ms/step, median [min–max] of {args.trials}; steps "
        f"{args.steps // 3}–{args.steps} of {args.steps}, padded to {args.step_ms:.0f} ms; {args.ranks} gloo ranks)"
    )
    print(f"| {'configuration':<14} | {'ms/step':>24} | {'/ off':>6} |")
    print(f"|{'-' * 16}|{'-' * 26}|{'-' * 8}|")
    for n, v in ok.items():
        cell = f"{med(v):.3f} [{min(v):.3f}–{max(v):.3f}]" if v else "—"
        ratio = f"{med(v) / med(ok['off']):.4f}" if v and ok["off"] else "—"
        print(f"| {n:<14} | {cell:>24} | {ratio:>6} |")
    if ok["off"] and ok["on, warm spare"]:
        over = med(ok["on, warm spare"]) / med(ok["off"]) - 1
        verdict = "met" if over <= GOAL else "MISSED"
        print(f"overhead {over * 100:+.2f} % (goal ≤ {GOAL * 100:.0f} %: {verdict})")
    print(f"load average at start {load0:.2f}, at end {os.getloadavg()[0]:.2f} (1 min)")
    failed = [n for n, v in times.items() if None in v]
    if failed:
        print("runs that failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
