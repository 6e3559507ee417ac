"""Step overhead of trainguard.Guard against the same DDP loop without it (goal: ≤ 1.01×).

Two gloo ranks (``torch.multiprocessing.spawn``, one CPU thread each) train a small MLP with DDP
and AdamW. In the same processes the benchmark alternates blocks of N plain steps (A) and N guarded
steps (B: ``for step in guard.steps(N): ...; guard.step_end(loss)``), and, as a reference, N plain
steps each followed by one bare 4-integer ``all_reduce`` (C: the collective the Guard's stop check
adds at every step with ``stop.check_interval = 1``; the default, auto, adds it about once a second), in the order ABCCBA ABCCBA ... so that drift
(thermal, other load) and ordering effects cancel. Each guarded block gets a fresh run
directory (``steps()`` would otherwise resume) and ``checkpoint.interval`` larger than N: no save
during the steps (saving is measured by ``checkpoint_throughput.py``); the block's final save
(``save_final``, which the Guard requires when no interval save happens) runs after its last timed step.

Reported (rank 0): median per-step wall time of each variant (the first step of every block is
dropped: for the Guard it includes ``_begin()``) and their ratio; the median over ABBA rounds of
(guarded time / plain time) per round; the same for the reference; the same for the process's CPU time per step (all its
threads; time spent descheduled or blocked is not counted, so it is much less sensitive to other
load on the machine); the time spent inside ``guard.step_end()`` per call; and the Guard's per-run
fixed cost (setup + the end-of-run state hash, without the final save) and the final save, for information.

Each guarded block trains a DDP model of its own (a copy of the plain loop's module, with its own
AdamW), as a job has: trainguard's communication hook goes on a DDP model once, so Guards made in
turn on one DDP model would leave the first one's hook on it, in every later block of every
variant. ``--step-ms 3`` (7, 30) pads every step of every variant with the same sleep, so that the
plain step lasts about that long; ``--ranks 4`` runs 4 ranks.

    .venv/bin/python benchmarks/step_overhead.py [--quick | --smoke] [--steps N] [--rounds R] [--hidden H] [--step-ms MS] [--ranks N]
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

from _common import NO_SCHEDULED_SAVES, SMOKE_HELP, add_pad_args

GOAL = 1.01


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run (~15 s) to check that it works")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--steps", type=int, default=None, help="steps per block (default 40, quick 30, smoke 4)")
    p.add_argument("--rounds", type=int, default=None, help="ABCCBA rounds (default 8, quick 2, smoke 1)")
    p.add_argument("--hidden", type=int, default=None, help="MLP width (sets the step time; default 768, smoke 64)")
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step (default 64, smoke 8)")
    p.add_argument("--check-interval", type=int, default=0, help="Guard stop.check_interval (0 = auto, the default)")
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the reference variant (plain loop + one bare 4-int all_reduce per step)",
    )
    add_pad_args(p)
    args = p.parse_args()
    args.steps = args.steps or (4 if args.smoke else 30 if args.quick else 40)
    args.rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 8)
    args.hidden = args.hidden or (64 if args.smoke else 128 if args.step_ms else 768)
    args.batch = args.batch or (8 if args.smoke else 64)
    args.warmup = 2 if args.smoke else 20
    return args


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from _common import ddp_copy, ddp_mlp, step_pad

    import trainguard
    from trainguard.events import read_events

    model, ddp, opt, x, y = ddp_mlp(rank, world, tmp, args.hidden, args.batch, lr=1e-4)

    def train_step(ddp=ddp, opt=opt) -> torch.Tensor:  # noqa: ANN001
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    warm = []
    for _ in range(args.warmup):  # warm-up: allocator, gloo buffers, DDP buckets
        t0 = time.perf_counter()
        train_step()
        warm.append(time.perf_counter() - t0)
    pad, compute = step_pad(warm, args.step_ms)  # --step-ms: the same sleep after every step

    n = args.steps
    wall = {"plain": [], "guarded": [], "collective": []}  # per block: per-step wall seconds
    cpu = {
        "plain": [],
        "guarded": [],
        "collective": [],
    }  # per block: per-step CPU seconds of this process (all threads)
    step_end_us: list[float] = []
    fixed_ms: list[float] = []
    final_save_ms: list[float] = []
    clock, cpu_clock = time.perf_counter, time.process_time

    def run_plain(variant: str = "plain") -> None:
        times, cpus = [], []
        t_prev, c_prev = clock(), cpu_clock()
        for _ in range(n):
            loss = train_step()
            loss = loss.detach()  # same work as the guarded loop minus step_end
            if variant == "collective":  # reference: what the Guard's per-step stop check costs by itself
                dist.all_reduce(torch.tensor([0, 0, 0, 0], dtype=torch.int64), op=dist.ReduceOp.MAX)
            time.sleep(pad)
            now, c_now = clock(), cpu_clock()
            times.append(now - t_prev)
            cpus.append(c_now - c_prev)
            t_prev, c_prev = now, c_now
        wall[variant].append(times[1:])
        cpu[variant].append(cpus[1:])

    def run_guarded(block: int) -> None:
        cfg = trainguard.load_config(
            None, [f"run.dir={tmp}/guard-{block}", *NO_SCHEDULED_SAVES, f"stop.check_interval={args.check_interval}"]
        )
        own, own_opt = ddp_copy(model, lr=1e-4)  # this Guard's communication hook goes on it
        t_start = clock()
        guard = trainguard.Guard(cfg, model=own, optimizer=own_opt)
        times, cpus, inside = [], [], []
        t_prev, c_prev = clock(), cpu_clock()
        for _step in guard.steps(n):
            loss = train_step(own, own_opt)
            t0 = clock()
            guard.step_end(loss=loss.detach())
            inside.append(clock() - t0)
            time.sleep(pad)
            now, c_now = clock(), cpu_clock()
            times.append(now - t_prev)
            cpus.append(c_now - c_prev)
            t_prev, c_prev = now, c_now
        t_end = clock()
        guard.close()  # its checkpoint threads and process groups too (steps() stopped the ping)
        wall["guarded"].append(times[1:])
        cpu["guarded"].append(cpus[1:])
        step_end_us.extend(v * 1e6 for v in inside[1:])
        # rank 0 writes the commit event; its seconds: write to commit of the final save
        save_s = (
            sum(e["details"]["seconds"] for e in read_events(guard.run_dir, "checkpoint_committed"))
            if rank == 0
            else 0.0
        )
        final_save_ms.append(save_s * 1e3)
        fixed_ms.append((t_end - t_start - sum(times[1:]) - statistics.median(times[1:]) - save_s) * 1e3)

    block = 0
    for _ in range(args.rounds):  # ABCCBA: plain, guard, collective, collective, guard, plain
        run_plain()
        run_guarded(block)
        block += 1
        if args.reference:
            run_plain("collective")
            run_plain("collective")
        run_guarded(block)
        block += 1
        run_plain()
    dist.barrier()
    if rank == 0:
        Path(tmp, "result.json").write_text(
            json.dumps(
                {
                    "wall": wall,
                    "cpu": cpu,
                    "step_end_us": step_end_us,
                    "fixed_ms": fixed_ms,
                    "final_save_ms": final_save_ms,
                    "compute_ms": compute * 1e3,
                }
            )
        )
    dist.destroy_process_group()


def main() -> int:
    args = _parse()
    import torch.multiprocessing as mp
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="tg-bench-overhead-") as tmp:
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(args.ranks, args, tmp), nprocs=args.ranks, join=True)
        wall = time.perf_counter() - t0
        res = json.loads(Path(tmp, "result.json").read_text())

    med = statistics.median

    def summary(d: dict, variant: str = "guarded") -> tuple[float, float, float, float, float]:
        """(plain median ms, variant median ms, ratio of medians, median of per-round ratios, ratio of means)"""
        p_all = [t for b in d["plain"] for t in b]
        g_all = [t for b in d[variant] for t in b]
        # per round: the variant's two blocks against the two plain blocks around them
        rounds = [
            (sum(d[variant][2 * i]) + sum(d[variant][2 * i + 1]))
            / (sum(d["plain"][2 * i]) + sum(d["plain"][2 * i + 1]))
            for i in range(len(d["plain"]) // 2)
        ]
        return (
            med(p_all) * 1e3,
            med(g_all) * 1e3,
            med(g_all) / med(p_all),
            med(rounds),
            statistics.fmean(g_all) / statistics.fmean(p_all),
        )

    w_p, w_g, w_ratio, w_round, w_mean = summary(res["wall"])
    c_p, c_g, c_ratio, c_round, c_mean = summary(res["cpu"])
    has_ref = bool(res["wall"]["collective"])
    if has_ref:
        _, r_w, r_ratio, r_round, _ = summary(res["wall"], "collective")
        _, r_c, rc_ratio, _, _ = summary(res["cpu"], "collective")
    se = sorted(res["step_end_us"])
    p90 = se[int(0.9 * (len(se) - 1))]

    def goal_fmt(r: float) -> str:
        return f"{'[green]' if r <= GOAL else '[red]'}{r:.4f}×"

    table = Table(
        title=f"Guard step overhead — {args.ranks} gloo ranks, DDP MLP width {args.hidden}, batch {args.batch}, "
        f"{args.rounds}× {'ABCCBA' if args.reference else 'ABBA'} blocks of {args.steps} steps, rank 0"
        + (f", steps padded to {args.step_ms:g} ms (compute {res['compute_ms']:.1f})" if args.step_ms else "")
    )
    for col in ("measure", "plain loop", "with Guard", "ratio", "goal"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    table.add_row("wall: median step (ms)", f"{w_p:.3f}", f"{w_g:.3f}", goal_fmt(w_ratio), f"≤ {GOAL:.2f}×")
    table.add_row("wall: median of per-round ratios", "", "", goal_fmt(w_round), f"≤ {GOAL:.2f}×")
    table.add_row("wall: ratio of means", "", "", f"{w_mean:.4f}×", "")
    table.add_row("CPU: median step (ms)", f"{c_p:.3f}", f"{c_g:.3f}", goal_fmt(c_ratio), "less sensitive to load")
    table.add_row("CPU: median of per-round ratios", "", "", goal_fmt(c_round), "")
    if has_ref:
        table.add_row(
            "ref: plain + bare all_reduce, wall (ms)",
            f"{w_p:.3f}",
            f"{r_w:.3f}",
            f"{r_ratio:.4f}× (rounds {r_round:.4f}×)",
            "not the Guard",
        )
        table.add_row(
            "ref: plain + bare all_reduce, CPU (ms)", f"{c_p:.3f}", f"{r_c:.3f}", f"{rc_ratio:.4f}×", "not the Guard"
        )
    table.add_row(
        "guard.step_end() wall per call (µs)",
        "",
        f"median {med(se):.0f}, p90 {p90:.0f}",
        f"{med(se) / 1e3 / w_p * 100:.2f}% of a step",
        "incl. waiting for the other rank",
    )
    table.add_row("Guard fixed cost per run (ms)", "", f"{med(res['fixed_ms']):.1f}", "", "setup + end hash, once")
    table.add_row(
        "final save per run (ms)", "", f"{med(res['final_save_ms']):.1f}", "", "after the last step, not in any step"
    )
    Console(width=150).print(table)
    print("block medians, wall ms  plain: " + " ".join(f"{med(b) * 1e3:.1f}" for b in res["wall"]["plain"]))
    print("                        guard: " + " ".join(f"{med(b) * 1e3:.1f}" for b in res["wall"]["guarded"]))
    if has_ref:
        print("       plain + all_reduce: " + " ".join(f"{med(b) * 1e3:.1f}" for b in res["wall"]["collective"]))
    print(
        f"check_interval={args.check_interval}; wall {wall:.1f} s; load average {os.getloadavg()[0]:.2f} "
        "(other processes on this 2-core machine add noise; compare runs on an idle machine)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
