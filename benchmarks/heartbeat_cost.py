"""Per-step cost on the rank of the hang supervisor's reports (heartbeat, sections) (goal: a few µs).

In one process (no process group, one CPU thread), blocks of ``--block`` calls of each operation
are timed with ``time.perf_counter_ns`` around the whole block, the operations taking turns block
by block (so that load changes on the machine spread over all of them):

* **empty call**: ``noop(i)``, an empty Python function with one argument (the baseline);
* ``HeartbeatWriter.beat(i)``; ``open("step")`` + ``close()`` (one pair per call);
* **per-step reports**: ``close(); beat(i); open("step")``, what the Guard does at each step;
* **Guard step**: one iteration of ``for step in guard.steps(N): guard.step_end()`` (a trivial
  model, ``checkpoint.interval`` 10^12, ``save_final = false``), without and with
  ``TRAINGUARD_HEARTBEAT_DIR`` set (two Guards in the same process); their difference is the
  supervisor's cost per training step.

Reported: the median over blocks of ns per call (wall, ``perf_counter_ns``), the 10th–90th
percentile range, the ratio to the empty call, the cost net of it, and the median thread CPU time per
call (``thread_time_ns``: time descheduled by other load is not counted). The record lives in ``/dev/shm`` like under ``trainguard run``.

    .venv/bin/python benchmarks/heartbeat_cost.py [--quick | --smoke] [--calls 200000] [--block 1000]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import SMOKE_HELP

GOAL_NS = 5_000  # "a few µs" per step


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20k calls per operation, to check that it works")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument(
        "--calls", type=int, default=None, help="calls per operation (default 200000, quick 20000, smoke 2000)"
    )
    p.add_argument("--block", type=int, default=None, help="calls per timed block (default 1000, smoke 200)")
    args = p.parse_args()
    args.calls = args.calls or (2_000 if args.smoke else 20_000 if args.quick else 200_000)
    args.block = args.block or (200 if args.smoke else 1000)
    return args


def noop(i: int) -> None:
    pass


def main() -> int:
    args = _parse()
    import torch
    from rich.console import Console
    from rich.table import Table

    import trainguard
    from trainguard.supervisor.heartbeat import HeartbeatWriter

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-hb-", dir=shm))
    runs = Path(tempfile.mkdtemp(prefix="tg-bench-hb-runs-"))
    try:
        writer = HeartbeatWriter(tmp / "bench.hb")

        def guard(name: str, heartbeat: bool) -> trainguard.Guard:
            if heartbeat:
                os.environ["TRAINGUARD_HEARTBEAT_DIR"] = str(tmp / "guard")
            else:
                os.environ.pop("TRAINGUARD_HEARTBEAT_DIR", None)
            cfg = trainguard.load_config(
                None, [f"run.dir={runs / name}", "checkpoint.interval=1000000000000", "checkpoint.save_final=false"]
            )
            g = trainguard.Guard(cfg, model=torch.nn.Linear(1, 1))
            os.environ.pop("TRAINGUARD_HEARTBEAT_DIR", None)
            return g

        g_plain, g_hb = guard("plain", False), guard("heartbeat", True)
        assert g_plain.heartbeat is None and g_hb.heartbeat is not None
        it_plain, it_hb = g_plain.steps(10**15), g_hb.steps(10**15)
        next(it_plain)  # _begin(): resume (nothing), start event
        next(it_hb)
        writer.open("step")

        def block_noop(n: int) -> int:
            t = time.perf_counter_ns()
            for i in range(n):
                noop(i)
            return time.perf_counter_ns() - t

        def block_beat(n: int) -> int:
            beat = writer.beat
            t = time.perf_counter_ns()
            for i in range(n):
                beat(i)
            return time.perf_counter_ns() - t

        def block_open_close(n: int) -> int:
            op, cl = writer.open, writer.close
            cl()  # leave the "step" section opened between blocks
            t = time.perf_counter_ns()
            for _ in range(n):
                op("eval")
                cl()
            dt = time.perf_counter_ns() - t
            op("step")
            return dt

        def block_step_reports(n: int) -> int:
            op, cl, beat = writer.open, writer.close, writer.beat
            t = time.perf_counter_ns()
            for i in range(n):
                cl()
                beat(i)
                op("step")
            return time.perf_counter_ns() - t

        def guard_block(g: trainguard.Guard, it):
            def run(n: int) -> int:
                end = g.step_end
                t = time.perf_counter_ns()
                for _ in range(n):
                    end()
                    next(it)
                return time.perf_counter_ns() - t

            return run

        ops = [
            ("empty call", "noop(i): an empty Python function (baseline)", block_noop),
            ("beat()", "HeartbeatWriter.beat(step)", block_beat),
            ("open() + close()", "enter and leave a section (one pair)", block_open_close),
            ("per-step reports", "close(); beat(step); open('step'): the Guard's per-step calls", block_step_reports),
            (
                "Guard step, no supervisor",
                "guard.step_end() + next(steps()), TRAINGUARD_HEARTBEAT_DIR unset",
                guard_block(g_plain, it_plain),
            ),
            ("Guard step, supervised", "the same with TRAINGUARD_HEARTBEAT_DIR set", guard_block(g_hb, it_hb)),
        ]
        samples: dict[str, list[float]] = {name: [] for name, _, _ in ops}
        cpu: dict[str, list[float]] = {name: [] for name, _, _ in ops}
        blocks = max(1, args.calls // args.block)
        for _, _, fn in ops:  # warm-up
            fn(args.block)
        gc.collect()
        t_wall = time.perf_counter()
        for b in range(blocks):
            order = ops if b % 2 == 0 else ops[::-1]  # ABC..CBA: drift cancels
            for name, _, fn in order:
                c0 = time.thread_time_ns()
                samples[name].append(fn(args.block) / args.block)
                cpu[name].append((time.thread_time_ns() - c0) / args.block)
        wall = time.perf_counter() - t_wall
        writer.close_file()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(runs, ignore_errors=True)

    med = statistics.median
    base = med(samples["empty call"])
    table = Table(
        title=f"cost per call on the rank (ns; median over {blocks} blocks of {args.block} calls = {blocks * args.block:,} calls each)"
    )
    for col in (
        "operation",
        "what",
        "median ns",
        "p10–p90 ns",
        "× empty call",
        "net of empty call ns",
        "CPU ns\n(median)",
    ):
        table.add_column(col, justify="left" if col in ("operation", "what") else "right")
    for name, what, _ in ops:
        v = samples[name]
        q = statistics.quantiles(v, n=10)
        m = med(v)
        table.add_row(
            name,
            what,
            f"{m:,.0f}",
            f"{q[0]:,.0f}–{q[-1]:,.0f}",
            f"{m / base:.1f}",
            f"{m - base:,.0f}",
            f"{med(cpu[name]):,.0f}",
        )
    Console(width=150).print(table)
    plain, hb = med(samples["Guard step, no supervisor"]), med(samples["Guard step, supervised"])
    # per-block paired difference (the blocks of the two guards run next to each other)
    paired = med(b - a for a, b in zip(samples["Guard step, no supervisor"], samples["Guard step, supervised"]))
    cost = hb - plain
    cpu_cost = med(b - a for a, b in zip(cpu["Guard step, no supervisor"], cpu["Guard step, supervised"]))
    print(
        f"supervisor cost per training step: {cost:,.0f} ns (difference of medians), {paired:,.0f} ns (median of paired "
        f"block differences); per-step reports alone {med(samples['per-step reports']) - base:,.0f} ns net; "
        f"CPU time {cpu_cost:,.0f} ns (paired); goal ≤ {GOAL_NS / 1e3:g} µs: {'met' if max(cost, paired) <= GOAL_NS else 'MISSED'} "
        f"(judged on wall time; CPU time, which excludes time descheduled, is less sensitive to other load)"
    )
    load1 = os.getloadavg()
    print(
        f"wall {wall:.1f} s; load average at start {load0[0]:.2f}, at end {load1[0]:.2f} (1 min) "
        f"(other processes on this machine add noise)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
