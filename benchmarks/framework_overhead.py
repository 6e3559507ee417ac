"""Step overhead of trainguard's framework callbacks: the same Lightning and Hugging Face Trainer jobs
with and without the callback, in one run.

The jobs are the tests' workers (``tests/lightning_worker.py``: an MLP regression under Lightning
DDP; ``tests/hf_worker.py``: a one-layer GPT-2 under the Trainer with DDP and gradient
accumulation 2), 2 gloo ranks under ``trainguard run``, widened by ``--hidden`` so that a step does
real work. **off**: the framework alone (``WORKER_PLAIN=1``); **on**: with ``TrainguardCallback``
(default config: the stop check about once a second, a checkpoint every 100 steps, the hang
supervisor's heartbeat, the NaN/spike check on every step). Step time: rank 0's seconds from one
batch end to the next, the median over the steps after the first tenth; trials alternate off and
on, and the table gives the median over trials. Overhead = on / off (goal ≤ 1.01); the cost is
mostly fixed per step (the NaN/spike check's all-reduce and host sync, the gradient norm computed
again because neither framework hands its own to callbacks), so the table also gives the added
milliseconds and the step time from which that meets the goal.

``--step-ms 3,7,30``: each worker's step padded by a sleep (in both arms, in the step-time callback)
to about each of those times, as ``per_step_cost.py`` does for the README's loop.

``--ranks 4``: 4 ranks per job.

    .venv/bin/python benchmarks/framework_overhead.py [--trials 3] [--steps 300] [--hidden 512] [--step-ms 3,7,30] [--ranks N] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from _common import SMOKE_HELP
from _common import trainguard_cmd as _trainguard

ROOT = Path(__file__).resolve().parent.parent
WORKERS = {"lightning": ROOT / "tests" / "lightning_worker.py", "hf": ROOT / "tests" / "hf_worker.py"}
GOAL = 1.01


def step_time(framework: str, plain: bool, args: argparse.Namespace, tmp: Path, pad_ms: float = 0.0) -> Optional[float]:
    """Median seconds per step of one launch; ``None`` if it failed (its log is printed)."""
    run = tmp / f"{framework}-{'off' if plain else 'on'}"
    shutil.rmtree(run, ignore_errors=True)
    times = tmp / "times.json"
    times.unlink(missing_ok=True)
    env = {**os.environ, "WORKER_TIMES": str(times), "WORKER_HIDDEN": str(args.hidden), "WORKER_PAD_MS": str(pad_ms)}
    if plain:
        env["WORKER_PLAIN"] = "1"
    script_args = [str(args.steps)] + ([str(tmp / "hf-out")] if framework == "hf" else [])
    cmd = _trainguard() + ["run", "--nproc-per-node", str(args.ranks), "--run-dir", str(run), str(WORKERS[framework])]
    # the frameworks decline in-process recovery (on by default): no warm spare competing for the cores
    cmd += script_args + ["--set", "checkpoint.interval=100", "--set", "recovery.in_process=false"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0 or not times.exists():
        print(f"{framework} ({'off' if plain else 'on'}) failed with {proc.returncode}:\n{proc.stdout[-3000:]}")
        return None
    seconds = json.loads(times.read_text())
    return statistics.median(seconds[len(seconds) // 10 :])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=512, help="the workers' width (512: ~30-60 ms steps on 2 CPU ranks)")
    p.add_argument("--frameworks", default="lightning,hf")
    p.add_argument(
        "--step-ms",
        default="",
        help="target step times, e.g. 3,7,30: each step padded by a sleep to about that long (from a first "
        "calibration run without the callback; a target below the step's own time leaves it as it is); "
        "default: the steps as they are",
    )
    p.add_argument("--ranks", type=int, default=2, help="ranks of each job (default 2)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.trials, args.steps, args.hidden = 1, 40, 64
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="tg-framework-") as d:
        for framework in args.frameworks.split(","):
            pads = [0.0]
            if args.step_ms:
                own = step_time(framework, True, args, Path(d))
                failed |= own is None
                pads = [max(0.0, float(t) - own * 1e3) for t in args.step_ms.split(",")] if own else []
            for pad in pads:
                off, on = [], []
                for _ in range(args.trials):
                    for plain, out in ((True, off), (False, on)):
                        t = step_time(framework, plain, args, Path(d), pad)
                        failed |= t is None
                        if t is not None:
                            out.append(t)
                if off and on:
                    a, b = statistics.median(off), statistics.median(on)
                    rows.append((framework, a, b, b / a))
    print(
        f"\nframework callback step overhead ({args.trials} trial(s) of {args.steps} steps, {args.ranks} gloo ranks, width {args.hidden})"
    )
    print(
        "| framework | step without (ms) | step with TrainguardCallback (ms) | ratio | goal | added per step (ms) | step for the goal (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for framework, a, b, ratio in rows:
        added = (b - a) * 1000
        print(
            f"| {framework} | {a * 1000:.2f} | {b * 1000:.2f} | {ratio:.3f} | ≤ {GOAL} | {added:.2f} | {added / (GOAL - 1):.0f} |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
