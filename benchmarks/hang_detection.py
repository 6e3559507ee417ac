"""Hang detection latency of ``trainguard run``: how long after its timeout a hung rank is detected.

Each launch runs the small job of ``benchmarks/_recovery_worker.py`` (2 gloo ranks, DDP MLP, steps
padded to ``--step-ms`` = 30 ms, a checkpoint every 10 steps) with a recurring hang::

    trainguard run --nproc-per-node 2 --inject rank_hung:rank=1,step=S,hang=MODE,every_attempt=true \\
        benchmarks/_recovery_worker.py --mode trainguard --set launcher.max_restarts=K \\
        --set supervisor.max_same_step_faults=1000 --set supervisor.max_no_progress_restarts=1000

Every attempt resumes from the checkpoint before step ``S`` and hangs again at ``S`` (the give-up
rules, which would stop a fault that recurs at the same step, are raised for the benchmark), so one
launch gives ``K + 1`` hangs; the launch ends when the restart budget is spent. ``S`` is drawn at
random for each launch (not a multiple of the checkpoint interval). Modes: ``sigstop`` (the rank
stops itself) and ``collective`` (its main thread blocks before the next collective, the peer waits
inside it). Each launch starts from the ``timeouts.json`` of the previous one (the first learns its
timeouts within its first attempt), so the timeouts in force are the learned ones.

For each hang, from ``RUN_DIR/events.jsonl``:

* **latency − timeout** = ``hang_detected.time − fault_injected.time − hang_detected.details.timeout``
  (goal ≤ 1 s): the monitor's poll interval (0.1 s), the stack dump taken before the event, minus
  the part of the step that ran before the fault (the section is timed from its start);
* **silent − timeout**: the monitor's own overshoot (``silent_seconds − timeout`` at detection);
* **hang → new start**: ``fault_injected`` → the next ``start`` event of rank 0 (the resumed loop
  is about to run its first step): detection, restart, process start, resume.

    .venv/bin/python benchmarks/hang_detection.py [--quick | --smoke] [--hangs 20] [--modes sigstop,collective]

``--smoke``: one launch per mode with two hangs (one restart), 10 ms steps, the hang at a step in
[22, 29] (after the 20 observed steps that the first attempt needs to learn its step timeout); it
exits 1 when a hang was not detected.
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
import time
from pathlib import Path
from typing import Optional

from _common import SMOKE_HELP  # noqa: E402
from _common import run_events as _events
from _common import trainguard_cmd as _trainguard

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "_recovery_worker.py"
MODES = ("sigstop", "collective")
GOAL = 1.0


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 hangs per mode in one launch each, to check that it works")
    p.add_argument(
        "--smoke", action="store_true", help=SMOKE_HELP + "; exits 1 when a hang was not detected (see above)"
    )
    p.add_argument("--hangs", type=int, default=None, help="hangs per mode, at least (default 20, quick 2, smoke 2)")
    p.add_argument("--per-launch", type=int, default=None, help="hangs per launch (default 10, quick 2, smoke 2)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of sigstop,collective")
    p.add_argument("--step-ms", type=float, default=None, help="pad every step to this duration (default 30, smoke 10)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--min-step",
        type=int,
        default=None,
        help="the hang step S is drawn from [min-step, max-step] (default 25, smoke 22)",
    )
    p.add_argument("--max-step", type=int, default=None, help="default 75, smoke 29")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cap",
        type=float,
        default=None,
        help="seconds after which a launch is killed (default 60 + 40 per hang; "
        "smoke 300: only against a stuck launch)",
    )
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    p.add_argument(
        "--analyse",
        metavar="DIR",
        default=None,
        help="print the table of launches kept with --keep in DIR, run nothing",
    )
    args = p.parse_args()
    args.hangs = args.hangs or (2 if args.quick or args.smoke else 20)
    args.per_launch = max(1, args.per_launch or (2 if args.quick or args.smoke else 10))
    args.step_ms = args.step_ms or (10.0 if args.smoke else 30.0)
    args.min_step = args.min_step or (22 if args.smoke else 25)
    args.max_step = args.max_step or (29 if args.smoke else 75)
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    return args


def launch(
    args: argparse.Namespace, mode: str, step: int, hangs: int, run_dir: Path, timeouts: Optional[Path]
) -> tuple[Optional[int], float]:
    """One launch with ``hangs`` recurring hangs (``hangs - 1`` restarts); returns (exit code or None if capped, seconds)."""
    run_dir.mkdir(parents=True)
    if timeouts is not None and timeouts.exists():
        shutil.copyfile(timeouts, run_dir / "timeouts.json")
    cmd = _trainguard() + [
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(run_dir),
        "--inject",
        f"rank_hung:rank=1,step={step},hang={mode},every_attempt=true",
        str(WORKER),
        "--mode",
        "trainguard",
        "--steps",
        "1000000",
        "--step-ms",
        str(args.step_ms),
        "--set",
        f"checkpoint.interval={args.ckpt_every}",
        "--set",
        f"launcher.max_restarts={hangs - 1}",
        "--set",
        "supervisor.max_same_step_faults=1000",
        "--set",
        "supervisor.max_no_progress_restarts=1000",
        "--set",
        "recovery.in_process=false",  # the group restart after each hang (in-process recovery is the default)
    ]
    cap = args.cap or (300 if args.smoke else 60 + 40 * hangs)
    t0 = time.perf_counter()
    with open(run_dir / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(cap)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    (run_dir / "launch.json").write_text(json.dumps({"mode": mode, "step": step, "code": code}))
    return code, time.perf_counter() - t0


def analyse(run_dir: Path, mode: str) -> list[dict]:
    """One record per injected hang of a launch."""
    ev = _events(run_dir)
    faults = [e for e in ev if e["kind"] == "fault_injected"]
    out = []
    for i, f in enumerate(faults):
        t_f = f["time"]
        t_next = faults[i + 1]["time"] if i + 1 < len(faults) else float("inf")
        dets = [e for e in ev if e["kind"] == "hang_detected" and t_f <= e["time"] < t_next]
        # the hung rank's own detection (its peer, waiting in a collective, may be detected too)
        det = next((e for e in dets if e["details"].get("rank") == f["rank"]), dets[0] if dets else None)
        start = next(
            (e for e in ev if e["kind"] == "start" and e["rank"] == 0 and e["attempt"] == f["attempt"] + 1), None
        )
        rec: dict = {"mode": mode, "attempt": f["attempt"], "step": f["step"], "run_dir": str(run_dir)}
        if det is not None:
            d = det["details"]
            rec.update(
                latency=det["time"] - t_f,
                timeout=d["timeout"],
                learned=d.get("learned"),
                section=d.get("section"),
                over=det["time"] - t_f - d["timeout"],
                silent_over=d["silent_seconds"] - d["timeout"],
                detected_rank=d.get("rank"),
                first_detected_rank=dets[0]["details"].get("rank"),
            )
        if start is not None:
            rec["recovery"] = start["time"] - t_f
        out.append(rec)
    return out


def _pct(vals: list[float], q: float) -> float:
    """Percentile with linear interpolation between the closest ranks (q in [0, 100])."""
    s = sorted(vals)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main() -> int:
    args = _parse()
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    load0 = os.getloadavg()
    t_wall = time.perf_counter()
    records: list[dict] = []
    codes: list[Optional[int]] = []
    if args.analyse:
        for d in sorted(Path(args.analyse).iterdir()):
            if (d / "launch.json").exists():
                info = json.loads((d / "launch.json").read_text())
                records += analyse(d, info["mode"])
                codes.append(info["code"])
        args.modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    else:
        base = Path(tempfile.mkdtemp(prefix="tg-bench-hang-"))
        rng = random.Random(args.seed)
        steps = [s for s in range(args.min_step, args.max_step + 1) if s % args.ckpt_every]
        timeouts: Optional[Path] = None
        try:
            n_launches = -(-args.hangs // args.per_launch)
            for i in range(n_launches):
                for mode in args.modes:  # modes alternate, so that load changes spread over both
                    step = rng.choice(steps)
                    run_dir = base / f"{mode}-{i}"
                    code, secs = launch(args, mode, step, args.per_launch, run_dir, timeouts)
                    codes.append(code)
                    recs = analyse(run_dir, mode)
                    records += recs
                    timeouts = run_dir / "timeouts.json"
                    overs = [r["over"] for r in recs if "over" in r]
                    console.print(
                        f"launch {i + 1}/{n_launches} {mode:<10} hang at step {step}: {len(recs)} hangs, "
                        f"latency − timeout median {statistics.median(overs) * 1e3:.0f} ms; exit code {code}, "
                        f"{secs:.0f} s, load {os.getloadavg()[0]:.2f}"
                        if overs
                        else f"launch {i + 1}/{n_launches} {mode}: no hang detected (exit code {code}); see {run_dir}/launcher.log"
                    )
        finally:
            if args.keep:
                print(f"run directories kept in {base}")
            else:
                shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t_wall

    med = statistics.median
    table = Table(
        title="hang detection of `trainguard run` (2 gloo ranks, "
        f"{args.step_ms:.0f} ms steps; rank 1 hangs in its step; seconds)"
    )
    for col, j in [
        ("mode", "left"),
        ("hangs", "right"),
        ("timeout used", "right"),
        ("learned", "right"),
        ("latency − timeout\np50 / p99 / max", "right"),
        ("silent − timeout\np50 / max", "right"),
        ("latency / timeout\np50", "right"),
        ("hang → new start\np50 / p99 / max", "right"),
        (f"goal: p99 latency − timeout ≤ {GOAL:g} s", "right"),
    ]:
        table.add_column(col, justify=j)  # type: ignore[arg-type]
    groups = [(m, [r for r in records if r["mode"] == m]) for m in args.modes]
    if len(groups) > 1:
        groups.append(("all", records))
    for name, recs in groups:
        det = [r for r in recs if "over" in r]
        if not det:
            table.add_row(name, str(len(recs)), "—", "—", "no hang detected", "", "", "", "")
            continue
        over = [r["over"] for r in det]
        silent = [r["silent_over"] for r in det]
        tos = [r["timeout"] for r in det]
        rec = [r["recovery"] for r in recs if "recovery" in r]
        p99 = _pct(over, 99)
        table.add_row(
            name,
            f"{len(det)}" + (f" ({len(recs) - len(det)} undetected)" if len(recs) > len(det) else ""),
            f"{med(tos):.2f}" + (f" ({min(tos):.2f}–{max(tos):.2f})" if min(tos) != max(tos) else ""),
            f"{sum(bool(r['learned']) for r in det)}/{len(det)}",
            f"{med(over):.3f} / {p99:.3f} / {max(over):.3f}",
            f"{med(silent):.3f} / {max(silent):.3f}",
            f"{med(r['latency'] / r['timeout'] for r in det):.3f}",
            f"{med(rec):.2f} / {_pct(rec, 99):.2f} / {max(rec):.2f}" if rec else "—",
            "met" if p99 <= GOAL else "MISSED",
        )
    console.print(table)
    sections = sorted({r.get("section") for r in records if r.get("section")})
    first_other = sum(1 for r in records if "over" in r and r["first_detected_rank"] != r["detected_rank"])
    console.print(
        f"hang steps {sorted({r['step'] for r in records})}; sections {sections}; the waiting peer was detected "
        f"before the hung rank in {first_other} hang(s); launch exit codes {codes} (76 = restart budget spent, expected)"
    )
    console.print(
        "latency = hang_detected − fault_injected; the section is timed from its start, slightly before the fault, "
        "and the event is written after the stack dump"
    )
    load1 = os.getloadavg()
    console.print(
        f"wall {wall:.0f} s; load average at start {load0[0]:.2f}, at end {load1[0]:.2f} (1 min), {load1[1]:.2f} (5 min) "
        "(2 ranks fill a 2-core machine: other load adds noise)"
    )
    undetected = [r for r in records if "over" not in r]
    if args.smoke and (undetected or not records):
        console.print(f"smoke: {len(undetected)} of {len(records)} injected hang(s) not detected")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
