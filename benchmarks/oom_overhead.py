"""Cost of OOM protection on normal steps (goal: ≤ 1.01×) and of a recovered out-of-memory step.

Two gloo ranks (``torch.multiprocessing.spawn``, one CPU thread each) train a DDP MLP with AdamW
under a Guard. In the same processes the benchmark alternates blocks of N steps of two loops, in
mirrored order (ABBA) so that drift and ordering effects cancel:

* A, OOM guard off: ``loss = F.cross_entropy(ddp(x), y); loss.backward()`` (DDP's own all-reduce,
  overlapped with backward);
* B, OOM guard on: ``loss = guard.run_step(step_fn, (x, y))`` with the whole batch as one
  micro-batch (backward under ``no_sync()``, then trainguard's bucketed all-reduce that carries the
  out-of-memory flags).

Then one guarded block with ``run_step`` injects an out-of-memory error on rank 1 every 10 steps
(a real allocator failure, alternately inside forward and at the start of backward; with
``grow_after = 1`` so the step after it is whole again) and reports the recovered step's time —
failed attempt, agreement, cleanup and the retry over two half micro-batches — against the
block's normal steps, and, for scale, steps that run two half micro-batches without a failure.

    .venv/bin/python benchmarks/oom_overhead.py [--quick | --smoke] [--steps N] [--rounds R] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

GOAL = 1.01


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from _common import NO_SCHEDULED_SAVES, abba, ddp_mlp, timed_block

    import trainguard

    model, ddp, opt, x, y = ddp_mlp(rank, world, tmp, args.hidden, args.batch, lr=1e-5)
    clock = time.perf_counter
    n, block = args.steps, [0]

    def step_fn(micro_batch):
        xb, yb = micro_batch
        return F.cross_entropy(ddp(xb), yb)

    def guard_for(*overrides: str) -> trainguard.Guard:
        cfg = trainguard.load_config(None, [f"run.dir={tmp}/run-{block[0]}", *NO_SCHEDULED_SAVES, *overrides])
        block[0] += 1
        return trainguard.Guard(cfg, model=ddp, optimizer=opt)

    def off_step(guard: trainguard.Guard):
        loss = step_fn((x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def on_step(guard: trainguard.Guard):
        loss = guard.run_step(step_fn, (x, y))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def run_block(variant: str, guard: trainguard.Guard) -> tuple[list[float], list[float]]:
        return timed_block(guard, n, off_step if variant == "off" else on_step)

    for _ in range(args.warmup_blocks):  # warm-up
        run_block("off", guard_for())
        run_block("on", guard_for())
    wall, cpu = abba(args.rounds, lambda variant: run_block(variant, guard_for()))

    # recovered out-of-memory steps
    oom_steps = list(range(10, 10 * args.rounds * 2 + 1, 10))
    inject = ", ".join(
        f"{{kind='oom', rank=1, step={s}, phase='{('forward', 'backward')[i % 2]}'}}" for i, s in enumerate(oom_steps)
    )
    guard = guard_for(f"faults.inject=[{inject}]", "oom.grow_after=1")
    times = {}
    for step in guard.steps(max(oom_steps) + 5):
        t0 = clock()
        loss = guard.run_step(step_fn, (x, y))
        opt.step()
        opt.zero_grad(set_to_none=True)
        guard.step_end(loss=loss.detach())
        times[step + 1] = clock() - t0
    recovered = [times[s] for s in oom_steps]
    normal = [t for s, t in times.items() if s not in oom_steps and s - 1 not in oom_steps and s > 2]
    # two half micro-batches without a failure
    guard = guard_for(f"oom.micro_batch_size={args.batch // 2}", "oom.grow=false")
    halves, _ = run_block("on", guard)
    dist.barrier()
    if rank == 0:
        Path(tmp, "result.json").write_text(
            json.dumps({"wall": wall, "cpu": cpu, "recovered": recovered, "normal": normal, "halves": halves})
        )
    dist.destroy_process_group()


def main() -> int:
    from _common import block_args, ratio_table, spawn_pair
    from rich.console import Console
    from rich.table import Table

    args = block_args(__doc__)
    res, seconds = spawn_pair(_worker, args, "tg-bench-oom-")
    med = statistics.median
    Console(width=160).print(
        ratio_table(
            f"OOM guard on normal steps — 2 gloo ranks, DDP MLP width {args.hidden}, batch {args.batch}, "
            f"{args.rounds}× ABBA blocks of {args.steps} steps, rank 0",
            "off: loss.backward() (A)",
            "on: guard.run_step (B)",
            res["wall"],
            res["cpu"],
            GOAL,
        )
    )

    normal = med(res["normal"]) * 1e3
    t2 = Table(
        title="a recovered out-of-memory step (rank 0; OOM injected on rank 1, alternately in forward and backward)"
    )
    for col in ("step", "count", "median (ms)", "÷ normal step"):
        t2.add_column(col, justify="left" if col == "step" else "right")
    t2.add_row("normal (whole batch)", str(len(res["normal"])), f"{normal:.3f}", "1.00×")
    t2.add_row(
        "two half micro-batches, no failure",
        str(len(res["halves"])),
        f"{med(res['halves']) * 1e3:.3f}",
        f"{med(res['halves']) * 1e3 / normal:.2f}×",
    )
    t2.add_row(
        "recovered: failed attempt + retry at half",
        str(len(res["recovered"])),
        f"{med(res['recovered']) * 1e3:.3f}",
        f"{med(res['recovered']) * 1e3 / normal:.2f}×",
    )
    Console(width=160).print(t2)
    print(f"wall {seconds:.1f} s; load average {os.getloadavg()[0]:.2f} (run on an idle machine; compare ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
