"""Step overhead of straggler timing and the liveness ping (goal: ≤ 1.01×).

Two gloo ranks (``torch.multiprocessing.spawn``, one CPU thread each) train a DDP MLP with AdamW
under a Guard, every step ``loss = guard.run_step(step_fn, (x, y))``, ``optimizer.step()``,
``guard.step_end(loss)``. In the same processes the benchmark alternates blocks of N steps of two
configurations, in mirrored order (ABBA) so that drift and ordering effects cancel:

* A, off: ``straggler.enabled = false``, ``health.ping = false``;
* B, on, pessimistic: ``straggler.enabled = true`` with ``report_interval_steps = 10`` and
  ``min_samples = 5`` (step and compute timing every step, a report at every stop check that is
  10 steps or more after the last one — the report rides on the stop check, about one a second by
  default), and ``health.ping = true`` with ``ping_interval = 0.5`` (a background all-reduce on a
  group of its own every half second) — far more often than the defaults of 300 s and 30 s.

Both have ``health.preflight = false`` (it runs once, before the first step). Each block builds its
own Guard (fresh run directory, no save before its final one, after the last step) and runs ``guard.steps()`` to its end on both ranks, so
that every B block stops its ping (a collective) before the next block starts; the first step of a
block, which includes the Guard's start, is not counted.

Reported (rank 0): the median wall and CPU step time of A and B, B / A, the median of per-round
ratios; from the B blocks, the pings completed and their median duration, and the
``straggler_report`` (and ``straggler_detected``) events written.

``--smoke``: 12 steps per block of a width-64 MLP, and in B a report every 4 steps after 2 warm-up
steps, a ping every 0.02 s and a stop check every 2 steps (``--check-interval``), so that the
short blocks still ping and report.

    .venv/bin/python benchmarks/health_overhead.py [--quick | --smoke] [--steps N] [--rounds R] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

GOAL = 1.01
OFF = ["straggler.enabled=false", "health.ping=false", "health.preflight=false"]
ON = [
    "straggler.enabled=true",
    "straggler.report_interval_steps=10",
    "straggler.min_samples=5",
    "health.ping=true",
    "health.ping_interval=0.5",
    "health.preflight=false",
]
# --smoke: blocks of 12 tiny steps (~0.1 s) still see pings and a straggler report
SMOKE_ON = [
    "straggler.report_interval_steps=4",
    "straggler.warmup_steps=2",
    "straggler.min_samples=2",
    "health.ping_interval=0.02",
]


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check-interval",
        type=int,
        default=0,
        help="stop.check_interval in both variants (0 = auto, the default); 10 makes B report every 10 steps",
    )


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from _common import NO_SCHEDULED_SAVES, abba, ddp_mlp, timed_block

    import trainguard
    from trainguard.events import read_events

    _, ddp, opt, x, y = ddp_mlp(rank, world, tmp, args.hidden, args.batch, lr=1e-5)
    block = [0]
    on: dict[str, list] = {"pings": [], "ping_seconds": [], "reports": [], "detected": []}

    def step_fn(micro_batch):
        xb, yb = micro_batch
        return F.cross_entropy(ddp(xb), yb)

    def run_block(variant: str) -> tuple[list[float], list[float]]:
        cfg = trainguard.load_config(
            None,
            [
                f"run.dir={tmp}/run-{block[0]}",
                *NO_SCHEDULED_SAVES,
                f"stop.check_interval={args.check_interval}",
                *((ON + (SMOKE_ON if args.smoke else [])) if variant == "on" else OFF),
            ],
        )
        block[0] += 1
        guard = trainguard.Guard(cfg, model=ddp, optimizer=opt)
        pings, seconds = [], []

        def step(guard: trainguard.Guard):
            if not pings and guard.ping is not None:  # first step: the ping starts in steps()' _begin()
                pings.append(guard.ping)
                _record_durations(guard.ping, seconds)
            loss = guard.run_step(step_fn, (x, y))
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        result = timed_block(guard, args.steps, step)
        if variant == "on":  # the Guard has finished: its ping stopped after the agreed number of pings
            on["pings"].append(pings[0].launched if pings else 0)
            on["ping_seconds"].extend(seconds)
            on["reports"].append(sum(1 for _ in read_events(guard.run_dir, "straggler_report")))
            on["detected"].append(sum(1 for _ in read_events(guard.run_dir, "straggler_detected")))
        return result

    for _ in range(args.warmup_blocks):  # warm-up
        run_block("off")
        run_block("on")
    for values in on.values():
        values.clear()
    wall, cpu = abba(args.rounds, run_block)
    dist.barrier()
    if rank == 0:
        Path(tmp, "result.json").write_text(json.dumps({"wall": wall, "cpu": cpu, **on}))
    dist.destroy_process_group()


def _record_durations(ping, seconds: list[float]) -> None:
    """Append the duration of each of ``ping``'s completed pings to ``seconds`` (from its thread)."""
    inner = ping._ping

    def timed(n, tensor) -> None:
        inner(n, tensor)
        seconds.append(ping.last_seconds)

    ping._ping = timed


def main() -> int:
    from _common import block_args, ratio_table, spawn_pair
    from rich.console import Console
    from rich.table import Table

    args = block_args(__doc__, extra=_options, smoke_steps=12)
    if args.smoke and not args.check_interval:
        args.check_interval = 2  # the straggler report rides on the stop check
    res, seconds = spawn_pair(_worker, args, "tg-bench-health-")
    check = f"stop.check_interval {args.check_interval}" if args.check_interval else "auto stop check"
    Console(width=160).print(
        ratio_table(
            f"straggler timing + liveness ping — 2 gloo ranks, DDP MLP width {args.hidden}, "
            f"batch {args.batch}, {args.rounds}× ABBA blocks of {args.steps} steps, {check}, rank 0",
            "off (A)",
            "on: reports ≥ 10 steps apart, ping every 0.5 s (B)",
            res["wall"],
            res["cpu"],
            GOAL,
        )
    )

    blocks = len(res["pings"])
    t2 = Table(title=f"in the {blocks} B blocks (rank 0)")
    for col in (
        "pings completed",
        "median ping (ms)",
        "max ping (ms)",
        "straggler_report events",
        "straggler_detected events",
    ):
        t2.add_column(col, justify="right")
    durations = [s for s in res["ping_seconds"] if s is not None]
    t2.add_row(
        str(sum(res["pings"])),
        f"{statistics.median(durations) * 1e3:.3f}" if durations else "-",
        f"{max(durations) * 1e3:.3f}" if durations else "-",
        str(sum(res["reports"])),
        str(sum(res["detected"])),
    )
    Console(width=160).print(t2)
    print(f"wall {seconds:.1f} s; load average {os.getloadavg()[0]:.2f} (run on an idle machine; compare ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
