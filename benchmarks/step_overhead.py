"""Step overhead of trainguard.Guard against the same DDP loop without it (goal: ≤ 1.01×).

Two gloo ranks (``torch.multiprocessing.spawn``, one CPU thread each) train a small MLP with DDP
and AdamW. In the same processes the benchmark alternates blocks of N plain steps and N guarded
steps (``for step in guard.steps(N): ...; guard.step_end(loss)``), in the order ABBA ABBA ... so
that drift (thermal, other load) and ordering effects cancel. Each guarded block gets a fresh run
directory (``steps()`` would otherwise resume) and ``checkpoint.interval`` larger than N with
``save_final=false``: saving is measured by ``checkpoint_throughput.py``, not here.

Reported (rank 0): median per-step wall time of each variant (the first step of every block is
dropped: for the Guard it includes ``_begin()``), their ratio, the time spent inside
``guard.step_end()`` per call, and the Guard's per-run fixed cost (setup + the end-of-run state
hash) for information.

    .venv/bin/python benchmarks/step_overhead.py [--quick] [--steps N] [--rounds R] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

GOAL = 1.01


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run (~15 s) to check that it works")
    p.add_argument("--steps", type=int, default=None, help="steps per block (default 150, quick 40)")
    p.add_argument("--rounds", type=int, default=None, help="ABBA rounds (default 4, quick 1)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (sets the step time)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--check-interval", type=int, default=1, help="Guard stop.check_interval")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 40 if args.quick else 150
    if args.rounds is None:
        args.rounds = 1 if args.quick else 4
    return args


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainguard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    torch.manual_seed(0)
    h = args.hidden
    model = nn.Sequential(nn.Linear(256, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 10))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 256, generator=g), torch.randint(0, 10, (args.batch,), generator=g)

    def train_step() -> torch.Tensor:
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(20):  # warm-up: allocator, gloo buffers, DDP buckets
        train_step()

    n = args.steps
    plain: list[list[float]] = []
    guarded: list[list[float]] = []
    step_end_us: list[float] = []
    fixed_ms: list[float] = []

    def run_plain() -> None:
        times = []
        t_prev = time.perf_counter()
        for _ in range(n):
            loss = train_step()
            loss = loss.detach()  # same work as the guarded loop minus step_end
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
        plain.append(times[1:])

    def run_guarded(block: int) -> None:
        cfg = trainguard.load_config(None, [f"run.dir={tmp}/guard-{block}", "checkpoint.interval=1000000",
                                            "checkpoint.save_final=false", f"stop.check_interval={args.check_interval}"])
        t_start = time.perf_counter()
        guard = trainguard.Guard(cfg, model=ddp, optimizer=opt)
        times, inside = [], []
        t_prev = time.perf_counter()
        for _step in guard.steps(n):
            loss = train_step()
            t0 = time.perf_counter()
            guard.step_end(loss=loss.detach())
            now = time.perf_counter()
            inside.append(now - t0)
            times.append(now - t_prev)
            t_prev = now
        t_end = time.perf_counter()
        guard.shutdown.uninstall()
        guarded.append(times[1:])
        step_end_us.extend(v * 1e6 for v in inside[1:])
        fixed_ms.append((t_end - t_start - sum(times[1:])) * 1e3 - statistics.median(times[1:]) * 1e3)

    block = 0
    for _ in range(args.rounds):  # ABBA
        run_plain()
        run_guarded(block); block += 1
        run_guarded(block); block += 1
        run_plain()
    dist.barrier()
    if rank == 0:
        Path(tmp, "result.json").write_text(json.dumps(
            {"plain": plain, "guarded": guarded, "step_end_us": step_end_us, "fixed_ms": fixed_ms}))
    dist.destroy_process_group()


def main() -> int:
    args = _parse()
    import torch.multiprocessing as mp
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="tg-bench-overhead-") as tmp:
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(2, args, tmp), nprocs=2, join=True)
        wall = time.perf_counter() - t0
        res = json.loads(Path(tmp, "result.json").read_text())

    med = statistics.median
    plain_blocks = [med(b) for b in res["plain"]]
    guard_blocks = [med(b) for b in res["guarded"]]
    plain_ms = med([t for b in res["plain"] for t in b]) * 1e3
    guard_ms = med([t for b in res["guarded"] for t in b]) * 1e3
    ratio = guard_ms / plain_ms
    # the paired ratio: each plain block against the guarded block next to it (ABBA pairs)
    pair_ratios = [g / p for p, g in zip(plain_blocks, guard_blocks)]
    pair_ratio = med(pair_ratios)
    se = res["step_end_us"]
    se_sorted = sorted(se)
    p90 = se_sorted[int(0.9 * (len(se_sorted) - 1))]
    mean_plain = statistics.fmean(t for b in res["plain"] for t in b) * 1e3
    mean_guard = statistics.fmean(t for b in res["guarded"] for t in b) * 1e3

    table = Table(title=f"Guard step overhead — 2 gloo ranks, DDP MLP width {args.hidden}, batch {args.batch}, "
                        f"{args.rounds}×ABBA blocks of {args.steps} steps")
    table.add_column("measure")
    table.add_column("plain loop", justify="right")
    table.add_column("with Guard", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("goal", justify="right")
    ok = "[green]" if ratio <= GOAL else "[red]"
    table.add_row("median step (ms)", f"{plain_ms:.3f}", f"{guard_ms:.3f}", f"{ok}{ratio:.4f}×", f"≤ {GOAL:.2f}×")
    table.add_row("median of paired block ratios", "", "", f"{pair_ratio:.4f}×", f"≤ {GOAL:.2f}×")
    table.add_row("mean step (ms)", f"{mean_plain:.3f}", f"{mean_guard:.3f}", f"{mean_guard / mean_plain:.4f}×", "")
    table.add_row("guard.step_end() per call (µs)", "", f"median {med(se):.0f}, p90 {p90:.0f}",
                  f"{med(se) / 1e3 / plain_ms * 100:.2f}% of a step", "")
    table.add_row("Guard fixed cost per run (ms)", "", f"{med(res['fixed_ms']):.1f}", "",
                  "setup + end hash, once")
    Console().print(table)
    print(f"block medians (ms) plain: {' '.join(f'{v * 1e3:.2f}' for v in plain_blocks)}")
    print(f"block medians (ms) guard: {' '.join(f'{v * 1e3:.2f}' for v in guard_blocks)}")
    print(f"check_interval={args.check_interval}; wall {wall:.1f} s; load average {os.getloadavg()[0]:.2f} "
          "(other processes on this 2-core machine add noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
