"""What in-process recovery's per-step keeping costs: one step boundary kept, in one process.

Each step boundary, in-process recovery keeps the rank's own state (its data position and RNG
streams: Python's, NumPy's, torch's) in memory and in a node-local file in ``/dev/shm``, so that a
replacement can take it (:mod:`trainguard.rejoin.boundary`), and at each step's start the
optimizer's hyperparameters and the scheduler's state (:class:`~trainguard.rejoin.stepstart.StepStart`,
put back when a step is done again). This measures that keeping exactly as the Guard does it
(``StepStart.begin``, ``TrainState.state_dict(LOCAL_PARTS)`` and ``BoundaryState.keep``; AdamW with
one parameter group and a ``LambdaLR``), in two kinds of step: one that draws from torch's CPU
generator (the RNG states are captured and encoded again), and one that draws no random number of
the host's (a loop whose data loader workers or own generator draw them: copy-on-change
reuses the kept RNG states, :class:`~trainguard.state.trainstate.RNGState`). Each against the same
loop without the keeping, in blocks alternated ABBA; the cost as a share of 3, 7 and 30 ms steps
(goal of issue 32: ≤ 0.1 ms, so ≤ 1.4 % of a 7 ms step).

    .venv/bin/python benchmarks/boundary_keep.py [--blocks 8] [--steps 2000] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import SMOKE_HELP

from trainguard.rejoin.boundary import BoundaryState
from trainguard.rejoin.rank import LOCAL_PARTS
from trainguard.rejoin.stepstart import StepStart
from trainguard.sampler import ResumableSampler
from trainguard.state.trainstate import RNGState, TrainState

GOAL_US = 100.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=8, help="ABBA blocks")
    p.add_argument("--steps", type=int, default=2000, help="boundaries per block")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.blocks, args.steps = 2, 50
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)
    state = TrainState({"sampler": ResumableSampler(100_000, rank=0, world_size=2, seed=1), "rng": RNGState()})
    draws = {"draws from torch's CPU generator": lambda: torch.rand(3), "draws no host random number": lambda: None}
    costs: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        kept = BoundaryState(Path(d), 0, stable=("rng",))  # as the Guard's (trainguard.rejoin.rank)
        step = [0]
        opt = torch.optim.AdamW(torch.nn.Linear(64, 64).parameters(), lr=1e-3)
        start = StepStart(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), lambda: False)
        for kind, draw in draws.items():

            def keeping() -> None:
                draw()  # noqa: B023 (called in this iteration only)
                step[0] += 1
                start.step_begin(1)
                kept.keep({"step": step[0], **state.state_dict(LOCAL_PARTS)})

            per = {"bare": [], "keeping": []}
            for i in range(args.blocks):
                pair = (("bare", draw), ("keeping", keeping))
                for name, fn in pair if i % 2 == 0 else pair[::-1]:
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        fn()
                    per[name].append((time.perf_counter() - t0) / args.steps * 1e6)
            costs[kind] = statistics.median(k - b for k, b in zip(per["keeping"], per["bare"]))
        size = sum(f.stat().st_size for f in Path(d).glob("rank0.boundary.*"))
        kept.close()
        start.close()
    table = Table(title=f"in-process recovery: one step boundary kept (median of {args.blocks} ABBA blocks)")
    for col in ("a step that", "cost of keeping (µs / step)", "goal", "share of 3 / 7 / 30 ms"):
        table.add_column(col, justify="left" if col == "a step that" else "right")
    for kind, cost in costs.items():
        mark = "[green]" if cost <= GOAL_US else "[red]"
        shares = " / ".join(f"{cost / (ms * 1e3) * 100:.2f} %" for ms in (3, 7, 30))
        table.add_row(kind, f"{mark}{cost:.1f}", f"≤ {GOAL_US:.0f}", shares)
    Console(width=120).print(table)
    print(f"boundary files: {size} bytes (two slots)")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
