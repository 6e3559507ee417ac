"""A rank of the README's plain loop SIGKILLed from outside at seeded random moments: in-process recovery
against the group restart, in the same run.

``examples/plain_loop.py`` (2 DDP ranks; ``loss.backward()``, ``optimizer.step()``, ``scheduler.step()``,
a logging all-reduce; no ``run_step``/``should_step``) runs under ``trainguard run``, once uninterrupted
for its final state hash, then ``--trials`` times per arm with one rank SIGKILLed from outside: at a
random step (after rank 0 printed it) plus a random fraction of a step, so the kill lands anywhere in
the step (forward, backward's all-reduce, the optimizer, the logging all-reduce, a save), on a rank
drawn at random. Arms:

* ``in-process``: ``recovery.in_process=true`` with one warm spare;
* ``restart``: ``recovery.in_process=false``, the group restart from the newest checkpoint (the baseline).

For each trial: whether it recovered in-process (no group restart, no fallback), whether the final
state equals the uninterrupted run's (bitwise), the completed steps trained again, and kill → training
again (the kill to the survivors' ``recovery_finished``, or to the restarted group's ``start``).

Run: ``python benchmarks/plain_loop_kills.py [--trials 20]``; ``--smoke`` for one short trial per arm.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import final_hash, kill_outcome, run_events, trainguard_cmd

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "plain_loop.py"
ARMS = {"in-process": ["recovery.in_process=true", "launcher.spares=1"], "restart": ["recovery.in_process=false"]}


def _launch(run: Path, steps: int, settings: list[str]) -> subprocess.Popen:
    sets = [x for s in [f"worker.max_steps={steps}", "checkpoint.interval=50", *settings] for x in ("--set", s)]
    cmd = [*trainguard_cmd(), "run", "--nproc-per-node", "2", "--run-dir", str(run), str(SCRIPT), *sets]
    return subprocess.Popen(cmd, stdout=open(f"{run}.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO)


def _printed_step(run: Path) -> int:
    try:
        lines = Path(f"{run}.log").read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    return max((int(x.split()[1].split("/")[0]) for x in lines if x.startswith("step ")), default=0)


def trial(run: Path, steps: int, settings: list[str], seed: int) -> dict:
    """One launch with one rank SIGKILLed at a seeded random moment; its measurements."""
    rng = random.Random(seed)
    kill_step, victim = rng.randint(steps // 8, steps * 3 // 4), rng.randint(0, 1)
    proc = _launch(run, steps, settings)
    deadline = time.monotonic() + 300
    while _printed_step(run) < kill_step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.random() * 0.02)  # about one step
    pids = next(e for e in run_events(run) if e["kind"] == "workers_started")["details"]["pids"]
    printed = _printed_step(run)
    killed_at = time.time()
    os.kill(int(pids[str(victim)]), signal.SIGKILL)
    code = proc.wait(timeout=600)
    in_process, again, redone = kill_outcome(run_events(run), killed_at, printed)
    return {"code": code, "in_process": in_process, "hash": final_hash(run), "again": again, "redone": redone}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="kills per arm")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="one trial per arm, 160 steps")
    args = p.parse_args()
    if args.smoke:
        args.trials, args.steps = 1, 160
    base = Path(tempfile.mkdtemp(prefix="plain-kills-"))
    clean = base / "clean"
    if _launch(clean, args.steps, []).wait(timeout=600) != 0:
        print(f"the uninterrupted run failed: {clean}.log", file=sys.stderr)
        return 1
    want = final_hash(clean)
    rows, failed = [], False
    for arm, settings in ARMS.items():
        results = [trial(base / f"{arm}-{i}", args.steps, settings, args.seed * 1000 + i) for i in range(args.trials)]
        failed |= any(r["code"] != 0 for r in results)
        rows.append((arm, results))
    base_again = statistics.median(r["again"] for r in rows[1][1])
    print(
        f"\nREADME plain loop (examples/plain_loop.py), 2 ranks, {args.steps} steps, one rank SIGKILLed at a random moment"
    )
    print(
        "| arm | trials | in-process | bitwise | completed steps redone (median) | kill → training again (median s) | vs restart |"
    )
    print("|---|---|---|---|---|---|---|")
    for arm, results in rows:
        n = len(results)
        again = statistics.median(r["again"] for r in results)
        print(
            f"| {arm} | {n} | {sum(r['in_process'] for r in results)}/{n} | {sum(r['hash'] == want for r in results)}/{n} "
            f"| {statistics.median(r['redone'] for r in results):g} | {again:.2f} | {again / base_again:.3f}× |"
        )
    print(f"goal (in-process): every trial in-process and bitwise, kill → training again ≤ 1.0 s; runs in {base}")
    return 1 if failed or (args.smoke and not rows[0][1][0]["in_process"]) else 0


if __name__ == "__main__":
    sys.exit(main())
