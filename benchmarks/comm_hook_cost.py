"""What riding in a gradient bucket costs by itself: a Python DDP communication hook against DDP's built-in one.

trainguard's values (the detectors', the stop check's, the replica check's) ride in a DDP gradient
bucket through a communication hook of its own (:class:`trainguard.rejoin.catch.DDPHook`), so the
step runs no collective of trainguard's. DDP's own all-reduce is C++; any hook written in Python
runs Python on the training thread for every bucket (and a completion callback). This benchmark
measures that floor apart from everything else trainguard does at a step, on 2 gloo ranks (one
thread each), three DDP copies of one MLP trained in the same processes, in blocks alternated
ABCCBA:

* **A, built-in**: DDP's default (its C++ all-reduce);
* **B, minimal Python hook**: divide by the world size, all-reduce, return the buffer through a
  ``then`` callback: the least a Python hook does (torch's own ``allreduce_hook`` does as much);
* **C, trainguard's hook**: :class:`~trainguard.rejoin.catch.DDPHook` with the detectors' values
  appended to its carrying bucket (:class:`~trainguard.instability.fold.LossFold`), without the
  step-boundary keep (``boundary_keep.py`` measures that).

Per arm: the training thread's CPU time per step (``time.thread_time``; median over rounds of the
blocks' means), what it adds to A, and that as a share of a 3, 7 and 30 ms step (the goals of
``per_step_cost.py``: 3 % at 3–7 ms, 1 % at 30 ms). ``--pad-ms``: a sleep after each step (the
per-step cost grows after a sleep on this VM: ``per_step_cost.py``'s notes).

    .venv/bin/python benchmarks/comm_hook_cost.py [--rounds 12] [--steps 20] [--pad-ms 0,2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import SMOKE_HELP, spawn_pair

ARMS = ("built-in", "minimal Python hook", "trainguard's hook")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12, help="ABCCBA rounds after a warm-up round")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--pad-ms", default="0,2", help="sleeps after each step to measure with (ms, comma-separated)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.pad_ms = 1, 3, "0"
    return args


def _worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.instability.fold import LossFold
    from trainguard.ranks import Ranks
    from trainguard.rejoin.catch import Catch, DDPHook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)

    def model() -> DDP:  # _step_worker.py's MLP, as per_step_cost.py measures
        torch.manual_seed(0)
        return DDP(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)))

    def minimal(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations: none here)
        buf, group = bucket.buffer(), dist.group.WORLD
        buf.div_(group.size())
        return group.allreduce([buf]).get_future().then(lambda f: f.value()[0])

    builtin, python, guarded = model(), model(), model()
    python.register_comm_hook(None, minimal)
    fold, step = LossFold(Ranks(rank, world)), [0]
    params, _ = guarded._build_params_for_reducer()
    hook = DDPHook(Catch(), params, None, lambda b: fold.extra(step[0], b), lambda v: fold.reduced(step[0], v))
    guarded.register_comm_hook(None, hook.hook)
    models = dict(zip(ARMS, (builtin, python, guarded)))
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)

    def train(name: str) -> None:
        step[0] += 1
        loss = nn.functional.cross_entropy(models[name](x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
        opts[name].step()
        opts[name].zero_grad()

    a, b, c = ARMS
    results = {}
    for pad_ms in (float(p) for p in args.pad_ms.split(",")):
        cpu: dict[str, list[float]] = {name: [] for name in ARMS}
        for r in range(args.rounds + 1):  # the first round warms up
            for name in (a, b, c, c, b, a):
                times = []
                for _ in range(args.steps):
                    c0 = time.thread_time()
                    train(name)
                    times.append(time.thread_time() - c0)
                    time.sleep(pad_ms / 1e3)
                if r:
                    cpu[name].append(statistics.mean(times))
        results[str(pad_ms)] = {name: statistics.median(v) for name, v in cpu.items()}
    if rank == 0:
        Path(tmp, "result.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> int:
    args = _parse()
    from rich.console import Console
    from rich.table import Table

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results, _ = spawn_pair(_worker, args, "tg-bench-hook-")
    table = Table(
        title=f"riding in a gradient bucket: a DDP communication hook's CPU per step, 2 gloo ranks, rank 0, "
        f"{args.rounds} ABCCBA round(s) of {args.steps} steps"
    )
    for col in ("sleep after the step", "arm", "CPU per step (µs)", "added (µs)", "share of 3 / 7 / 30 ms"):
        table.add_column(col, justify="right")
    for pad, by_arm in results.items():
        base = by_arm[ARMS[0]]
        for name in ARMS:
            added = by_arm[name] - base
            share = " / ".join(f"{added / (ms / 1e3):.1%}" for ms in (3, 7, 30)) if name != ARMS[0] else ""
            table.add_row(f"{float(pad):g} ms", name, f"{by_arm[name] * 1e6:.0f}", f"{added * 1e6:+.0f}", share)
    Console(width=150).print(table)
    print(f"load average {os.getloadavg()[0]:.2f} (2-core machine: other processes add noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
