"""What trainguard costs per step: the README's loop with and without it, at 3, 7 and 30 ms steps, 2 and 4 ranks.

The job (``_step_worker.py``): a small MLP under DDP on gloo, one CPU thread per rank, each step
followed by a fixed sleep so that it lasts about the target time; launched by ``trainguard run``
both ways, so only the script differs:

* **plain**: ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``;
* **trainguard**: the same loop as the README writes it (``guard.steps``, ``should_step(loss,
  grad_norm)``, ``step_end``), the default configuration (in-process recovery on: the step
  boundary kept every step, a warm spare waiting; the instability detectors; the stop check), no
  interval save during the timed steps (saves are ``checkpoint_throughput.py``'s and
  ``goodput_faults.py``'s).

The sleep is ``target − compute``, compute being the plain loop's median step measured first
(per rank count), and is the same for both: what trainguard adds to a step shows in full. Runs
alternate plain, trainguard, trainguard, plain (``--rounds`` times); each reports the median step of
rank 0 after its warm-up. Ratio = median over runs of trainguard / median of plain (goals of issue
32: ≤ 1.03× at 3–7 ms, ≤ 1.01× at 30 ms). *noise*: the slowest plain run's median over the
fastest one's, the spread of the same job run again on this machine (a ratio within it is not
resolved). *own collectives / step*: collectives trainguard called
itself from the training thread during the timed steps (DDP's gradient buckets are the loop's
own, even through trainguard's communication hook; the goal is 0). *host syncs / step*:
trainguard's tensor→host conversions per step, counted in ``steps / 10`` untimed steps after the timed ones
(each a device→host sync on a GPU; goal: at most 1, the instability check's).

``--fsdp2``: the same MLP ``fully_shard``-ed on a 1-D mesh of the ranks instead of DDP; the loop's
``clip_grad_norm_`` all-reduce is its own (trainguard's values ride in it).

    .venv/bin/python benchmarks/per_step_cost.py [--rounds 2] [--steps 300] [--ranks 2,4] [--step-ms 3,7,30] [--fsdp2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import NO_SCHEDULED_SAVES, SMOKE_HELP
from _common import trainguard_cmd as _trainguard

WORKER = Path(__file__).resolve().parent / "_step_worker.py"
GOALS = {3.0: 1.03, 7.0: 1.03, 30.0: 1.01}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="plain/trainguard/trainguard/plain rounds per cell")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 300; smoke 30)")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--step-ms", default="3,7,30")
    p.add_argument("--fsdp2", action="store_true", help="the model fully_shard-ed on a 1-D mesh (FSDP2) instead of DDP")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.ranks, args.step_ms = 1, "2", "3"
    args.steps = args.steps or (30 if args.smoke else 300)
    args.warmup = args.steps // 5
    args.count_syncs = max(2, args.steps // 10)
    return args


def _run(args: argparse.Namespace, tmp: Path, name: str, ranks: int, pad_ms: float, guard: bool) -> dict:
    out = tmp / f"{name}.json"
    cmd = _trainguard() + ["run", "--nproc-per-node", str(ranks), "--run-dir", str(tmp / name)]
    cmd += [a for s in NO_SCHEDULED_SAVES for a in ("--set", s)] + [str(WORKER), "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--pad-ms", str(pad_ms)]
    cmd += ["--count-syncs", str(args.count_syncs)]
    if guard:
        cmd += ["--guard"]
    if args.fsdp2:
        cmd += ["--fsdp2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        sys.exit(f"per_step_cost: {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    args = _parse()
    from rich.console import Console
    from rich.table import Table

    med = statistics.median
    model = "FSDP2" if args.fsdp2 else "DDP"
    table = Table(title=f"trainguard's cost per step — the README's loop, gloo {model}, rank 0, {args.rounds} round(s)")
    cols = ("ranks", "target step", "plain (ms)", "trainguard (ms)", "ratio", "goal", "noise (plain/plain)")
    for col in (*cols, "own collectives / step", "host syncs / step"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory(prefix="tg-bench-step-") as tmp_name:
        tmp = Path(tmp_name)
        for ranks in (int(r) for r in args.ranks.split(",")):
            compute = med(_run(args, tmp, f"calibrate-{ranks}", ranks, 0.0, False)["times"]) * 1e3
            for target in (float(t) for t in args.step_ms.split(",")):
                pad = max(0.0, target - compute)
                plain, guarded, own, steps, syncs = [], [], 0, 0, []
                for i in range(args.rounds):
                    for kind in ("plain", "guard", "guard", "plain"):
                        r = _run(
                            args,
                            tmp,
                            f"{kind}-{ranks}-{target}-{i}-{len(plain) + len(guarded)}",
                            ranks,
                            pad,
                            kind == "guard",
                        )
                        (guarded if kind == "guard" else plain).append(med(r["times"]) * 1e3)
                        if kind == "guard":
                            own, steps = own + r["own_collectives"], steps + len(r["times"])
                            syncs.append(r["syncs"])
                ratio = med(guarded) / med(plain)
                noise = max(plain) / min(plain)  # the same job run again: what a ratio this close to 1 cannot resolve
                goal = GOALS.get(target)
                mark = "" if goal is None else "[green]" if ratio <= goal else "[red]"
                table.add_row(
                    str(ranks),
                    f"{target:g} ms (compute {compute:.1f})",
                    f"{med(plain):.3f}",
                    f"{med(guarded):.3f}",
                    f"{mark}{ratio:.4f}×",
                    f"≤ {goal}×" if goal else "",
                    f"{noise:.3f}×",
                    f"{own / max(steps, 1):.4f}",
                    f"{max(syncs):.2f}",
                )
    Console(width=150).print(table)
    print(f"load average {os.getloadavg()[0]:.2f} (2-core machine: other processes add noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
