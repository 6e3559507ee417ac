"""What trainguard costs per step: the README's loop with and without it, at 3, 7 and 30 ms steps, 2 and 4 ranks.

The job (``_step_worker.py``): a small MLP under DDP on gloo, one CPU thread per rank, each step
followed by a fixed sleep so that it lasts about the target time; launched by ``trainguard run``:

* **plain**: ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``;
* **trainguard**: the same loop as the README writes it (``guard.steps``, ``should_step(loss,
  grad_norm)``, ``step_end``), the default configuration (in-process recovery on: the step
  boundary kept every step, a warm spare waiting; the instability detectors; the stop check), no
  interval save during the timed steps (saves are ``checkpoint_throughput.py``'s and
  ``goodput_faults.py``'s).

The sleep is ``target − compute``, compute being the plain loop's median step measured first
(per rank count), and is the same for both: what trainguard adds to a step shows in full.

**Paired** (the default): both loops in one job, in blocks of steps alternated plain, trainguard,
trainguard, plain (``--rounds`` ABBA rounds after a warm-up round; blocks of about 0.15 s, at
least 10 steps). The plain loop trains a second model of the same shape in the same processes,
between two steps of ``guard.steps``. Ratio = the median over rounds of (trainguard blocks' median
steps) / (plain blocks'); *rounds* gives the quartiles of the per-round ratios, the spread a ratio
this close to 1 cannot beat. *CPU added*: the training thread's CPU time per step, trainguard's
blocks minus the plain ones (median over rounds): the cost a host-bound step pays whatever the
machine's noise. Two launches of the same job differ by up to 14 % on 2 shared cores; blocks side
by side see the same machine. What runs beside the step (trainguard's threads, the warm spare, the
launcher) runs through both kinds of block alike here: ``--launches`` measures that part.

**Launches** (``--launches``): each loop its own job, runs alternated plain, trainguard,
trainguard, plain (``--rounds`` times); ratio = median over runs of trainguard / median of plain;
*rounds* gives the slowest plain run's median over the fastest one's.

*own collectives / step*: collectives trainguard called itself from the training thread (DDP's
gradient buckets are the loop's own, even through trainguard's communication hook; the goal is 0).
*host syncs / step*: trainguard's tensor→host conversions per step (each a device→host sync on a
GPU; goal: at most 1, the instability check's). Both counted in ``steps / 10`` guarded steps after
the timed ones (launches: collectives during the timed steps).

``--fsdp2``: the same MLP ``fully_shard``-ed on a 1-D mesh of the ranks instead of DDP; the loop's
``clip_grad_norm_`` all-reduce is its own (trainguard's values ride in it).

``--set KEY=VALUE``: a configuration override for both loops' runs (what a part of trainguard costs:
``--set recovery.in_process=false`` leaves out the step-boundary keep and the warm spare).

    .venv/bin/python benchmarks/per_step_cost.py [--rounds 10] [--steps 300] [--ranks 2,4] [--step-ms 3,7,30] [--launches] [--fsdp2] [--set K=V] [--smoke]
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
    p.add_argument(
        "--rounds", type=int, default=None, help="ABBA rounds per cell (default 10 paired, 2 with --launches)"
    )
    p.add_argument(
        "--launches", action="store_true", help="each loop its own job, runs alternated (see the module doc)"
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 300; smoke 30)")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--step-ms", default="3,7,30")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a configuration override for every run (repeatable), e.g. recovery.in_process=false",
    )
    p.add_argument("--fsdp2", action="store_true", help="the model fully_shard-ed on a 1-D mesh (FSDP2) instead of DDP")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.ranks, args.step_ms = 1, "2", "3"
    args.rounds = args.rounds or (2 if args.launches else 10)
    args.steps = args.steps or (30 if args.smoke else 300)
    args.warmup = args.steps // 5
    args.count_syncs = max(2, args.steps // 10)
    return args


def _run(
    args: argparse.Namespace, tmp: Path, name: str, ranks: int, pad_ms: float, guard: bool, block: int = 0
) -> dict:
    out = tmp / f"{name}.json"
    cmd = _trainguard() + ["run", "--nproc-per-node", str(ranks), "--run-dir", str(tmp / name)]
    cmd += [a for s in NO_SCHEDULED_SAVES + args.set for a in ("--set", s)] + [str(WORKER), "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--pad-ms", str(pad_ms)]
    cmd += ["--count-syncs", str(args.count_syncs)]
    if guard:
        cmd += ["--guard"]
    if block:
        cmd += ["--paired", str(block), "--rounds", str(args.rounds)]
    if args.fsdp2:
        cmd += ["--fsdp2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        sys.exit(f"per_step_cost: {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _paired(args: argparse.Namespace, tmp: Path, ranks: int, target: float, pad: float) -> tuple:
    """One job, ABBA blocks: (plain ms, trainguard ms, ratio, rounds' spread, CPU added µs, own collectives, syncs)."""
    med = statistics.median
    r = _run(args, tmp, f"paired-{ranks}-{target}", ranks, pad, True, block=max(10, round(150 / target)))
    rounds = [r["blocks"][i : i + 4] for i in range(0, len(r["blocks"]), 4)]
    plain = [(b[0]["wall"] + b[3]["wall"]) / 2 for b in rounds]
    guard = [(b[1]["wall"] + b[2]["wall"]) / 2 for b in rounds]
    cpu = [(b[1]["cpu"] + b[2]["cpu"] - b[0]["cpu"] - b[3]["cpu"]) / 2 for b in rounds]
    ratios = [g / p for g, p in zip(guard, plain)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    spread = f"{q[0]:.3f}–{q[2]:.3f}×"
    return (
        med(plain) * 1e3,
        med(guard) * 1e3,
        med(ratios),
        spread,
        f"{med(cpu) * 1e6:.0f}",
        r["own_collectives"],
        r["syncs"],
    )


def _launches(args: argparse.Namespace, tmp: Path, ranks: int, target: float, pad: float) -> tuple:
    """Runs alternated plain, trainguard, trainguard, plain: as :func:`_paired`, without the CPU time."""
    med = statistics.median
    plain, guarded, own, steps, syncs = [], [], 0, 0, []
    for i in range(args.rounds):
        for kind in ("plain", "guard", "guard", "plain"):
            name = f"{kind}-{ranks}-{target}-{i}-{len(plain) + len(guarded)}"
            r = _run(args, tmp, name, ranks, pad, kind == "guard")
            (guarded if kind == "guard" else plain).append(med(r["times"]) * 1e3)
            if kind == "guard":
                own, steps = own + r["own_collectives"], steps + len(r["times"])
                syncs.append(r["syncs"])
    noise = f"{max(plain) / min(plain):.3f}×"  # the same job run again
    return med(plain), med(guarded), med(guarded) / med(plain), noise, "", own / max(steps, 1), max(syncs)


def main() -> int:
    args = _parse()
    from rich.console import Console
    from rich.table import Table

    design = "runs alternated" if args.launches else "ABBA blocks in one job"
    model = "FSDP2" if args.fsdp2 else "DDP"
    table = Table(
        title=f"trainguard's cost per step — the README's loop, gloo {model}, rank 0, {args.rounds} round(s), {design}"
    )
    spread = "noise (plain/plain)" if args.launches else "rounds (quartiles)"
    cols = ("ranks", "target step", "plain (ms)", "trainguard (ms)", "ratio", "goal", spread, "CPU added (µs)")
    for col in (*cols, "own collectives / step", "host syncs / step"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory(prefix="tg-bench-step-") as tmp_name:
        tmp = Path(tmp_name)
        for ranks in (int(r) for r in args.ranks.split(",")):
            compute = statistics.median(_run(args, tmp, f"calibrate-{ranks}", ranks, 0.0, False)["times"]) * 1e3
            for target in (float(t) for t in args.step_ms.split(",")):
                cell = _launches if args.launches else _paired
                plain, guarded, ratio, noise, cpu, own, syncs = cell(
                    args, tmp, ranks, target, max(0.0, target - compute)
                )
                goal = GOALS.get(target)
                mark = "" if goal is None else "[green]" if ratio <= goal else "[red]"
                table.add_row(
                    str(ranks),
                    f"{target:g} ms (compute {compute:.1f})",
                    f"{plain:.3f}",
                    f"{guarded:.3f}",
                    f"{mark}{ratio:.4f}×",
                    f"≤ {goal}×" if goal else "",
                    noise,
                    cpu,
                    f"{own:.4f}",
                    f"{syncs:.2f}",
                )
    Console(width=170).print(table)
    print(f"load average {os.getloadavg()[0]:.2f} (2-core machine: other processes add noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
