"""Step overhead of the instability detectors (goal: ≤ 1.01×) and host syncs per step (goal: one).

Two gloo ranks (``torch.multiprocessing.spawn``, one CPU thread each) train a DDP MLP with AdamW
and gradient clipping. In the same processes the benchmark alternates blocks of N steps of three
loops, in a mirrored order so that drift and ordering effects cancel:

* A, plain: ``clip_grad_norm_``, ``optimizer.step()``;
* B, Guard without detectors: A inside ``guard.steps()`` / ``guard.step_end()``;
* C, Guard with every detector: B plus ``if guard.should_step(loss, grad_norm):`` around the
  optimizer step (non-finite loss and gradients, loss and gradient-norm spikes; all on);
* D, reference: B plus one bare 6-float ``all_reduce`` and one ``tolist()`` per step, the
  collective and sync the detectors need by design, without their logic (order ABCDDCBA).

Each guarded block gets a DDP model of its own (a copy of the warmed-up module, weights and all,
with its own AdamW), and the plain loop one copy for all its blocks, as a job has: trainguard's
communication hook goes on a DDP model once, so Guards made in turn on one DDP model would all
but the first miss it, and with it the fold (the detectors' values riding in a gradient bucket,
:mod:`trainguard.instability.fold`). So C pays what the README's loop pays: no collective of the
detectors' own and one host sync per step.

Reported (rank 0): median per-step wall time of each loop and the ratios C/B (the detectors' own
cost, the goal) and C/A (the whole Guard), plus CPU-time ratios (less sensitive to other load).
Then, in one extra guarded block, ``should_step()`` is instrumented: a ``TorchFunctionMode``
counts every tensor→host conversion (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``,
``numpy``, ``cpu``) and wrappers count ``torch.distributed`` collectives, per call after the
first (whose values no bucket carries yet).

``--step-ms 3`` (7, 30) pads every step of every loop with the same sleep, so that the plain step
lasts about that long, as a GPU step whose host work is this loop's; ``--ranks 4`` runs 4 ranks.

    .venv/bin/python benchmarks/instability_overhead.py [--quick | --smoke] [--steps N] [--rounds R] [--hidden H] [--step-ms MS] [--ranks N]
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
SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "broadcast_object_list", "all_gather_object", "barrier")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run to check that it works")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument("--steps", type=int, default=None, help="steps per block (default 40, quick 20, smoke 4)")
    p.add_argument("--rounds", type=int, default=None, help="ABCDDCBA rounds (default 6, quick 1, smoke 1)")
    p.add_argument("--hidden", type=int, default=None, help="MLP width (sets the step time; default 1024, smoke 64)")
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step (default 64, smoke 8)")
    add_pad_args(p)
    args = p.parse_args()
    args.steps = args.steps or (4 if args.smoke else 20 if args.quick else 40)
    args.rounds = args.rounds or (1 if args.smoke or args.quick else 6)
    args.hidden = args.hidden or (64 if args.smoke else 128 if args.step_ms else 1024)
    args.batch = args.batch or (8 if args.smoke else 64)
    args.warmup = 2 if args.smoke else 20
    return args


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from _common import ddp_copy, ddp_mlp, step_pad
    from torch.overrides import TorchFunctionMode

    import trainguard

    model, ddp, opt, x, y = ddp_mlp(rank, world, tmp, args.hidden, args.batch, lr=1e-5)
    clock, cpu_clock = time.perf_counter, time.process_time

    def forward_backward(ddp=ddp, opt=opt) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss, torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), 1.0)  # the loss backward() ran on

    warm = []
    for _ in range(args.warmup):  # warm-up
        t0 = clock()
        forward_backward()
        opt.step()
        warm.append(clock() - t0)
    pad, compute = step_pad(warm, args.step_ms)  # --step-ms: the same sleep after every step

    n, block = args.steps, [0]
    wall = {"plain": [], "guard": [], "detectors": [], "reference": []}
    cpu = {"plain": [], "guard": [], "detectors": [], "reference": []}

    def timed(variant: str, steps) -> None:
        times, cpus = [], []
        t_prev, c_prev = clock(), cpu_clock()
        for _ in steps:
            now, c_now = clock(), cpu_clock()
            times.append(now - t_prev)
            cpus.append(c_now - c_prev)
            t_prev, c_prev = now, c_now
        wall[variant].append(times[2:])  # drop the Guard's first yield (setup) and the first step
        cpu[variant].append(cpus[2:])

    plain_ddp, plain_opt = ddp_copy(model, lr=1e-5)  # A on a copy too: its CPU ran above B's on the first DDP model

    def plain():
        for _ in range(n + 1):
            yield
            forward_backward(plain_ddp, plain_opt)
            plain_opt.step()
            time.sleep(pad)
        yield

    def guarded(variant: str, guard_box: list):
        cfg = trainguard.load_config(None, [f"run.dir={tmp}/run-{block[0]}", *NO_SCHEDULED_SAVES])
        block[0] += 1
        own, own_opt = ddp_copy(model, lr=1e-5)
        guard = trainguard.Guard(cfg, model=own, optimizer=own_opt)
        guard_box.append(guard)
        yield
        for _ in guard.steps(n + 1):
            loss, norm = forward_backward(own, own_opt)
            if variant == "reference":
                packed = torch.stack([loss.detach(), norm, loss.detach(), norm, loss.detach(), norm])
                dist.all_reduce(packed)
                packed.tolist()
            if variant != "detectors" or guard.should_step(loss, norm):
                own_opt.step()
            guard.step_end(loss=loss)
            time.sleep(pad)
            yield
        guard.close()  # its checkpoint threads and process groups too (steps() stopped the ping)

    for _ in range(args.rounds):
        for variant in ("plain", "guard", "detectors", "reference", "reference", "detectors", "guard", "plain"):
            timed(variant, plain() if variant == "plain" else guarded(variant, []))

    # instrumented block: what one should_step() does
    counts = {"syncs": [], "collectives": []}

    class CountSyncs(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in SYNCS:
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, fn in originals.items():
        setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    cfg = trainguard.load_config(None, [f"run.dir={tmp}/run-count", *NO_SCHEDULED_SAVES])
    guard = trainguard.Guard(cfg, model=ddp, optimizer=opt)
    for _ in guard.steps(n):
        loss, norm = forward_backward()
        calls.clear()
        with CountSyncs() as mode:
            ok = guard.should_step(loss, norm)
        counts["syncs"].append(mode.names)
        counts["collectives"].append(list(calls))
        if ok:
            opt.step()
        guard.step_end(loss=loss)
    for name, fn in originals.items():
        setattr(dist, name, fn)
    dist.barrier()
    if rank == 0:
        result = {"wall": wall, "cpu": cpu, "counts": counts, "compute_ms": compute * 1e3}
        Path(tmp, "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    args = _parse()
    import torch.multiprocessing as mp
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="tg-bench-instab-") as tmp:
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(args.ranks, args, tmp), nprocs=args.ranks, join=True)
        seconds = time.perf_counter() - t0
        res = json.loads(Path(tmp, "result.json").read_text())

    med = statistics.median

    def per_round(d: dict, a: str, b: str) -> float:
        """median over rounds of (b's two blocks) / (a's two blocks)"""
        r = [
            (sum(d[b][2 * i]) + sum(d[b][2 * i + 1])) / (sum(d[a][2 * i]) + sum(d[a][2 * i + 1]))
            for i in range(len(d[a]) // 2)
        ]
        return med(r)

    def median_ms(d: dict, v: str) -> float:
        return med([t for blk in d[v] for t in blk]) * 1e3

    def fmt(r: float, goal: bool = True) -> str:
        return (f"{'[green]' if r <= GOAL else '[red]'}{r:.4f}×") if goal else f"{r:.4f}×"

    table = Table(
        title=f"Instability detectors — {args.ranks} gloo ranks, DDP MLP width {args.hidden}, batch {args.batch}, "
        f"{args.rounds}× ABCDDCBA blocks of {args.steps} steps, rank 0"
        + (f", steps padded to {args.step_ms:g} ms (compute {res['compute_ms']:.1f})" if args.step_ms else "")
    )
    for col in (
        "measure",
        "plain (A)",
        "Guard (B)",
        "Guard + detectors (C)",
        "B + bare all_reduce (D)",
        "C / B",
        "D / B",
        "C / A",
        "goal",
    ):
        table.add_column(col, justify="left" if col == "measure" else "right")
    for label, d in (("wall", res["wall"]), ("CPU", res["cpu"])):
        table.add_row(
            f"{label}: median step (ms)",
            *(f"{median_ms(d, v):.3f}" for v in ("plain", "guard", "detectors", "reference")),
            fmt(median_ms(d, "detectors") / median_ms(d, "guard")),
            fmt(median_ms(d, "reference") / median_ms(d, "guard"), False),
            fmt(median_ms(d, "detectors") / median_ms(d, "plain"), False),
            f"C/B ≤ {GOAL:.2f}×",
        )
        table.add_row(
            f"{label}: median of per-round ratios",
            "",
            "",
            "",
            "",
            fmt(per_round(d, "guard", "detectors")),
            fmt(per_round(d, "guard", "reference"), False),
            fmt(per_round(d, "plain", "detectors"), False),
            "",
        )
    Console(width=160).print(table)
    syncs = [len(s) for s in res["counts"]["syncs"][1:]]  # after the first step, which all-reduces (fold.py)
    colls = [len(c) for c in res["counts"]["collectives"][1:]]
    kinds = sorted(
        {name for s in res["counts"]["syncs"][1:] for name in s}
        | {name for c in res["counts"]["collectives"][1:] for name in c}
    )
    t2 = Table(
        title=f"per guard.should_step() call, {len(syncs)} healthy steps after the first (goal: one host sync, "
        "no collective: the values ride in a gradient bucket)"
    )
    for col in ("measure", "min", "max", "what"):
        t2.add_column(col)
    t2.add_row("device→host syncs", str(min(syncs)), str(max(syncs)), ", ".join(k for k in kinds if k in SYNCS))
    t2.add_row("collectives", str(min(colls)), str(max(colls)), ", ".join(k for k in kinds if k in COLLECTIVES))
    Console(width=160).print(t2)
    print(f"wall {seconds:.1f} s; load average {os.getloadavg()[0]:.2f} (run on an idle machine; compare ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
