"""A killed rank: in-process recovery (warm spare, cold replacement) against the group restart.

The job of ``benchmarks/recovery_compare.py`` (``_recovery_worker.py``: 2 gloo DDP ranks, an MLP,
steps padded to ``--step-ms`` = 30 ms, a checkpoint every 10 steps; rank 1 SIGKILLs itself at step
``--fault-step`` = 125 of 150), its loop through ``guard.run_step``/``guard.should_step``, under
``trainguard run`` three ways, trials interleaved:

* **restart**: today's path: the group is killed and restarted, resumes from the newest checkpoint
  (``recovery_compare.py`` puts this path beside torchrun and ft_launcher);
* **in-process, cold**: ``[recovery] in_process``, ``[launcher] spares = 0``: rank 0 stays, a new
  process replaces rank 1;
* **in-process, warm**: the same with one warm spare waiting in the script's ``init_process_group``.

Time to recover = ``fault_injected`` → rank 0 ready to train again (its ``start`` event in the
restarted attempt, or its ``recovery_finished``); steps lost = completed steps trained again
(the fault step minus the step training resumes from). Medians and ranges of ``--trials`` (6).

The steady-state cost of the machinery (the per-step boundary state written to ``/dev/shm``, the
spare waiting beside the ranks) is measured on the same job without a fault: the step time
(``start`` → ``end`` of rank 0, per step) with in-process recovery and a warm spare against
without, trials interleaved.

    .venv/bin/python benchmarks/inprocess_recovery.py [--trials 6] [--smoke]
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
    "restart": ["recovery.in_process=false"],
    "in-process, cold": ["recovery.in_process=true", "launcher.spares=0"],
    "in-process, warm": ["recovery.in_process=true", "launcher.spares=1"],
}


def _launch(args: argparse.Namespace, name: str, run_dir: Path, fault: bool) -> tuple[int, list[dict]]:
    sets = [f"checkpoint.interval={args.ckpt_every}", *CONFIGS[name]]
    inject = ["--inject", f"rank_killed:rank=1,step={args.fault_step}"] if fault else []
    cmd = _trainguard() + [
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(run_dir),
        *inject,
        str(WORKER),
        "--mode",
        "trainguard",
        "--guard-api",
        "--steps",
        str(args.steps),
        "--step-ms",
        str(args.step_ms),
        *[x for s in sets for x in ("--set", s)],
    ]
    code = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300).returncode
    return code, _events(run_dir)


def step_time(args: argparse.Namespace, name: str, run_dir: Path) -> Optional[float]:
    """Seconds per step of a run without a fault (rank 0's start → end), ``None`` if it failed."""
    code, ev = _launch(args, name, run_dir, fault=False)
    start = next((e for e in ev if e["kind"] == "start" and e["rank"] == 0), None)
    end = next((e for e in ev if e["kind"] == "end" and e["rank"] == 0), None)
    if code != 0 or start is None or end is None:
        return None
    return (end["time"] - start["time"]) / (end["step"] - start["details"]["first_step"])


def trial(args: argparse.Namespace, name: str, run_dir: Path) -> dict:
    code, ev = _launch(args, name, run_dir, fault=True)
    fault = next((e for e in ev if e["kind"] == "fault_injected"), None)
    if fault is None or code != 0:
        return {"name": name, "error": f"exit code {code}, fault injected: {fault is not None}"}
    ready = next(
        (e for e in ev if e["rank"] == 0 and e["time"] > fault["time"] and e["kind"] in ("start", "recovery_finished")),
        None,
    )
    if ready is None:
        return {"name": name, "error": "rank 0 never trained again"}
    resumed = ready["details"]["first_step"] if ready["kind"] == "start" else ready["step"]
    return {"name": name, "seconds": ready["time"] - fault["time"], "lost": fault["step"] - resumed, "error": None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=None, help="trials per configuration (default 6, smoke 1)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--step-ms", type=float, default=None, help="pad every step to this (default 30, smoke 10)")
    p.add_argument("--steps", type=int, default=None, help="steps of the job (default 150, smoke 40)")
    p.add_argument(
        "--fault-step", type=int, default=None, help="rank 1 is killed after this step (default 125, smoke 25)"
    )
    p.add_argument("--ckpt-every", type=int, default=10)
    args = p.parse_args()
    args.trials = args.trials or (1 if args.smoke else 6)
    args.step_ms = args.step_ms or (10.0 if args.smoke else 30.0)
    args.steps = args.steps or (40 if args.smoke else 150)
    args.fault_step = args.fault_step or (25 if args.smoke else 125)
    base = Path(tempfile.mkdtemp(prefix="tg-bench-inprocess-"))
    load0 = os.getloadavg()[0]
    results: list[dict] = []
    steady: dict[str, list[Optional[float]]] = {}
    try:
        for t in range(args.trials):
            for name in CONFIGS:
                r = trial(args, name, base / f"{name.replace(', ', '-').replace(' ', '-')}-{t}")
                results.append(r)
                got = f"{r['seconds']:.2f} s, {r['lost']} steps lost" if r["error"] is None else r["error"]
                print(f"trial {t + 1}/{args.trials} {name:>17}: {got}", flush=True)
            for name in ("restart", "in-process, warm"):
                st = step_time(args, name, base / f"steady-{name.replace(', ', '-')}-{t}")
                steady.setdefault(name, []).append(st)
                print(f"trial {t + 1}/{args.trials} {name:>17}: no fault, {st and st * 1e3:.2f} ms/step", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    ok = {n: [r for r in results if r["name"] == n and r["error"] is None] for n in CONFIGS}
    base_med = med([r["seconds"] for r in ok["restart"]]) if ok["restart"] else None
    print(
        f"\nkill of rank 1 at step {args.fault_step} → rank 0 training again (s; median [min–max] of "
        f"{args.trials}); 2 gloo ranks, {args.step_ms:.0f} ms steps, checkpoint every {args.ckpt_every}"
    )
    print(f"| {'configuration':<17} | {'seconds':>22} | {'/ restart':>9} | steps lost | failed |")
    print(f"|{'-' * 19}|{'-' * 24}|{'-' * 11}|{'-' * 12}|{'-' * 8}|")
    for n in CONFIGS:
        s = [r["seconds"] for r in ok[n]]
        lost = sorted({r["lost"] for r in ok[n]})
        failed = sum(1 for r in results if r["name"] == n and r["error"])
        cell = f"{med(s):.2f} [{min(s):.2f}–{max(s):.2f}]" if s else "—"
        ratio = f"{med(s) / base_med:.2f}" if s and base_med else "—"
        print(f"| {n:<17} | {cell:>22} | {ratio:>9} | {','.join(map(str, lost)) or '—':>10} | {failed:>6} |")
    off = [x for x in steady.get("restart", []) if x is not None]
    on = [x for x in steady.get("in-process, warm", []) if x is not None]
    if off and on:
        print(
            f"\nsteady state, no fault ({args.steps} steps padded to {args.step_ms:.0f} ms): "
            f"{med(off) * 1e3:.2f} ms/step without in-process recovery, {med(on) * 1e3:.2f} ms/step with it and a "
            f"warm spare: overhead {(med(on) / med(off) - 1) * 100:+.1f} % (median of {len(on)})"
        )
    print(f"load average at start {load0:.2f}, at end {os.getloadavg()[0]:.2f} (1 min)")
    errors = [f"{r['name']}: {r['error']}" for r in results if r["error"]]
    errors += [f"{n}: the run without a fault failed" for n, v in steady.items() if None in v]
    if errors:
        print("did not recover: " + " | ".join(errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
