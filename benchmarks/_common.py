"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from trainguard.events import read_events


def trainguard_cmd() -> list[str]:
    """The ``trainguard`` command of this interpreter's environment."""
    exe = Path(sys.executable).parent / "trainguard"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "trainguard.cli"]


def run_events(run_dir: Path) -> list[dict]:
    """All events of a run directory (malformed lines skipped)."""
    return list(read_events(run_dir))


def final_hash(run_dir: Path) -> str | None:
    """The final state hash of the run's last launch that ended with 0 (``None``: none did)."""
    done = [e for e in run_events(run_dir) if e["kind"] == "launch_exit" and e["details"]["code"] == 0]
    return done[-1]["details"]["state_sha256"] if done else None


def kill_outcome(events: list[dict], killed_at: float, printed: int, last: bool = False) -> tuple[bool, float, int]:
    """What a kill at wall time ``killed_at`` (``printed``: the newest step printed then) cost, from
    the run's ``events``: whether it was recovered in-process (no group restart, no fallback), kill
    → training again (to the survivors' first ``recovery_finished``, the last one with ``last``;
    else to the restarted group's ``start``; NaN when neither came) and the completed steps trained
    again (in-process: ``steps_lost``, 0 but for a sharded model's rollback; else since the
    checkpoint the restart resumed from)."""
    kinds = {e["kind"] for e in events}
    if "recovery_finished" in kinds and not kinds & {"group_restart", "recovery_fallback"}:
        done = [e["time"] for e in events if e["kind"] == "recovery_finished"]
        lost = max(e["details"].get("steps_lost", 0) for e in events if e["kind"] == "recovery_finished")
        return True, (max(done) if last else min(done)) - killed_at, lost
    starts = [e["time"] for e in events if e["kind"] == "start" and e["time"] > killed_at]
    again = min(starts) - killed_at if starts else float("nan")
    resumed = [e["details"]["from_step"] for e in events if e["kind"] == "resume" and e["time"] > killed_at]
    return False, again, max(printed - resumed[0], 0) if resumed else printed


def exited(pid: int) -> bool:
    """True once ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def ddp_mlp(rank: int, world: int, tmp: str, hidden: int, batch: int, lr: float):
    """The benchmarks' training job: one CPU thread, a gloo group (file rendezvous in ``tmp``), a
    4-layer MLP of width ``hidden`` under DDP with AdamW, and a fixed batch of ``batch`` samples.

    Returns:
        (model, ddp, optimizer, x [batch, 256], y [batch]).
    """
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    torch.manual_seed(0)
    h = hidden
    model = nn.Sequential(
        nn.Linear(256, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model, DDP(model), opt, x, y


# The Guard refuses a run whose persistent tier would never save (``checkpoint.interval`` larger
# than ``max_steps`` with ``save_final = false``: exit 2), so a benchmark that measures steps
# without saves keeps the final save and moves the interval beyond any block: the one save of a
# block is the final one, inside ``steps()``' end, after the last timed step.
NO_SCHEDULED_SAVES = ["checkpoint.interval=1000000000", "checkpoint.save_final=true"]

# --smoke: the smallest sizes that still run every part of a benchmark and print its tables, in
# a few seconds (benchmarks/test_smoke.py runs every benchmark so); its numbers mean nothing.
SMOKE_HELP = "smallest sizes, a few seconds: checks that the benchmark runs to its tables (numbers meaningless)"


def block_args(
    doc: str, order: str = "ABBA", extra: Callable[[argparse.ArgumentParser], None] | None = None, smoke_steps: int = 4
) -> argparse.Namespace:
    """Command-line arguments of a benchmark of alternated step blocks: ``--quick`` (1 round of 20
    steps), ``--smoke`` (1 round of ``smoke_steps`` steps, width 64, batch 8, no warm-up blocks), ``--steps``
    (default 40), ``--rounds`` (default 8), ``--hidden`` (1024), ``--batch`` (64); ``extra(parser)``
    adds the script's own. The description is ``doc``'s first paragraph."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run to check that it works")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument(
        "--steps", type=int, default=None, help=f"steps per block (default 40, quick 20, smoke {smoke_steps})"
    )
    p.add_argument("--rounds", type=int, default=None, help=f"{order} rounds (default 8, quick 1, smoke 1)")
    p.add_argument("--hidden", type=int, default=None, help="MLP width (sets the step time; default 1024, smoke 64)")
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step (default 64, smoke 8)")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    args.steps = args.steps or (smoke_steps if args.smoke else 20 if args.quick else 40)
    args.rounds = args.rounds or (1 if args.smoke or args.quick else 8)
    args.hidden = args.hidden or (64 if args.smoke else 1024)
    args.batch = args.batch or (8 if args.smoke else 64)
    args.warmup_blocks = 0 if args.smoke else 2
    return args


def add_pad_args(p: argparse.ArgumentParser) -> None:
    """``--ranks`` (default 2) and ``--step-ms`` (each step of every variant padded with the same
    sleep, :func:`step_pad`) for a benchmark of alternated step blocks."""
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="pad every step of every variant with a sleep to about this long (the plain step measured "
        "first; default: no pad; width 128 unless --hidden)",
    )


def step_pad(warm: list[float], step_ms: Optional[float]) -> tuple[float, float]:
    """``(pad, compute)`` seconds: ``compute`` is the slowest rank's median plain step over the
    second half of ``warm`` (its warm-up steps' seconds, past DDP's bucket rebuild; an all-reduce),
    ``pad`` the sleep that makes a step last about ``step_ms`` (0 without it, or when the compute
    is longer already)."""
    import torch
    import torch.distributed as dist

    compute = torch.tensor(statistics.median(warm[len(warm) // 2 :]))
    dist.all_reduce(compute, op=dist.ReduceOp.MAX)
    return (max(step_ms / 1e3 - compute.item(), 0.0) if step_ms else 0.0), compute.item()


def ddp_copy(model: Any, lr: float) -> tuple[Any, Any]:
    """A DDP model of its own around a copy of ``model`` (weights and all) and an AdamW on it:
    trainguard's communication hook goes on a DDP model once, so each Guard needs its own."""
    import copy

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = copy.deepcopy(model)
    return DDP(module), torch.optim.AdamW(module.parameters(), lr=lr)


def spawn_pair(worker: Callable, args: Any, prefix: str) -> tuple[dict, float]:
    """Run ``worker(rank, 2, args, tmp)`` on two ranks (``torch.multiprocessing.spawn``) in a fresh
    temporary directory ``tmp``; rank 0 writes its results to ``tmp/result.json``.

    Returns:
        (the results, the wall seconds of the whole spawn).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        t0 = time.perf_counter()
        mp.spawn(worker, args=(2, args, tmp), nprocs=2, join=True)
        seconds = time.perf_counter() - t0
        return json.loads(Path(tmp, "result.json").read_text()), seconds


def timed_block(guard: Any, n: int, step: Callable[[Any], Any]) -> tuple[list[float], list[float]]:
    """Run ``guard.steps(n + 1)`` to its end (so that the Guard finishes: ping stopped, ranks leave
    together), each step ``loss = step(guard)`` then ``guard.step_end(loss)``, both timed; then
    close the Guard (``guard.close()``: its signal handlers, event log, checkpoint threads and
    process groups, so that no block runs beside the ones before it).

    Returns:
        (wall seconds, CPU seconds) of each step but the first (it includes the Guard's start).
    """
    clock, cpu_clock = time.perf_counter, time.process_time
    times, cpus = [], []
    for _ in guard.steps(n + 1):
        t0, c0 = clock(), cpu_clock()
        loss = step(guard)
        guard.step_end(loss=loss.detach())
        times.append(clock() - t0)
        cpus.append(cpu_clock() - c0)
    guard.close()  # its checkpoint threads and process groups too (steps() stopped the ping)
    return times[1:], cpus[1:]


def abba(rounds: int, run_block: Callable[[str], tuple[list[float], list[float]]]) -> tuple[dict, dict]:
    """``rounds`` rounds of blocks in mirrored order off, on, on, off (drift and order effects cancel);
    ``run_block(variant)`` returns a block's (wall, CPU) step times.

    Returns:
        (wall, cpu): ``{"off": [block, ...], "on": [block, ...]}`` each, two blocks per round.
    """
    wall: dict[str, list] = {"off": [], "on": []}
    cpu: dict[str, list] = {"off": [], "on": []}
    for _ in range(rounds):
        for variant in ("off", "on", "on", "off"):
            t, c = run_block(variant)
            wall[variant].append(t)
            cpu[variant].append(c)
    return wall, cpu


def median_ms(blocks: list[list[float]]) -> float:
    """Median step of all ``blocks`` (lists of seconds), in milliseconds."""
    return statistics.median([t for blk in blocks for t in blk]) * 1e3


def per_round(on_blocks: list[list[float]], off_blocks: list[list[float]]) -> float:
    """Median over ABBA rounds of (the round's two "on" blocks' time) / (its two "off" blocks' time)."""
    return statistics.median(
        [
            (sum(on_blocks[2 * i]) + sum(on_blocks[2 * i + 1])) / (sum(off_blocks[2 * i]) + sum(off_blocks[2 * i + 1]))
            for i in range(len(off_blocks) // 2)
        ]
    )


def ratio_cell(r: float, goal: float) -> str:
    """``r`` for a rich table: green when it meets ``goal`` (≤), red when not."""
    return f"{'[green]' if r <= goal else '[red]'}{r:.4f}×"


def ratio_table(title: str, off: str, on: str, wall: dict, cpu: dict, goal: float) -> Any:
    """A rich table (measure, ``off``, ``on``, B / A, goal): median step (ms) of each variant and
    their ratio, and the median of per-round ratios, for wall and CPU time (dicts as :func:`abba`
    returns); ratios green when they meet ``goal`` (≤), red when not."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("measure", off, on, "B / A", "goal"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    for label, d in (("wall", wall), ("CPU", cpu)):
        a, b = median_ms(d["off"]), median_ms(d["on"])
        table.add_row(f"{label}: median step (ms)", f"{a:.3f}", f"{b:.3f}", ratio_cell(b / a, goal), f"≤ {goal:.2f}×")
        table.add_row(
            f"{label}: median of per-round ratios", "", "", ratio_cell(per_round(d["on"], d["off"]), goal), ""
        )
    return table
