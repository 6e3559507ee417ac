"""A sharded model's in-memory snapshot: how long it blocks training, against the asynchronous save.

Two gloo ranks, an MLP sharded with FSDP2 (``fully_shard`` per layer and at the root) whose fp32
parameters plus AdamW's two moments take ``--mb`` MiB over both ranks (each rank holds half). Each
method runs ``--reps`` times on the same live state, alternated (ABAB; the first of each is a
warm-up, not counted), each time followed by a forward and backward and the ``optimizer.step()``:

* ``async save`` — trainguard's asynchronous save to the persistent tier (``Checkpointer.save(...,
  blocking=False)``, what ``[checkpoint] async_save`` does): blocked = the save call plus the time
  the next ``optimizer.step()`` waits for the background copy of parameters and optimizer states;
  the write itself runs in the background (waited for outside the timing);
* ``snapshot`` — in-process recovery's snapshot (``ShardSnapshots.take``, every
  ``[recovery] snapshot_interval`` steps): blocked = the call, the ``optimizer.step()`` wait for its
  background copy, and the next boundary's wait for the copy's exchange with the holder.

The ``optimizer.step()`` wait is that step's time minus the median of steps with neither. Also: the
copy's bytes and exchange time (serialize, sizes, send and receive, in the background thread) as
bytes/s, against a plain gloo ``send``/``recv`` of the same bytes between the two ranks (the
loopback's bandwidth: the limit of a peer transfer). Goal: the snapshot blocks no longer than the
asynchronous save. ``--smoke``: 2 MiB, 2 repetitions (checks the path; numbers meaningless).

    .venv/bin/python benchmarks/snapshot_stall.py [--smoke] [--mb 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMOKE_HELP, spawn_pair  # noqa: E402

GOAL = 1.0
WIDTH = 512


def _model(mb: int):
    """An FSDP2-sharded MLP of ``WIDTH``-wide layers whose parameters and two AdamW moments take
    about ``mb`` MiB in all, and its optimizer (stepped once, so that its state exists)."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(mb * 2**20 / (3 * 4 * WIDTH * WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _forward_backward(model, x) -> None:
    model(x).square().mean().backward()


def worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint.checkpointer import Checkpointer
    from trainguard.config import load_config
    from trainguard.events import EventLog
    from trainguard.ranks import Ranks
    from trainguard.rejoin.shards import ShardSnapshots

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    model, opt = _model(args.mb)
    x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(rank))
    _forward_backward(model, x)
    opt.step()
    opt.zero_grad()
    run = Path(tmp, "run")
    run.mkdir(exist_ok=True)
    cfg = load_config(None, [f"run.dir={run}", "checkpoint.keep_last=1"])
    ckpt = Checkpointer(
        cfg.checkpoint, run, EventLog(run, rank), model, opt, Ranks(rank, world), 0, world, background=True
    )
    snaps = ShardSnapshots(model, opt, 1, rank, world, world)
    snaps.regroup()

    def step(before=None, after=None) -> dict:
        """One step with ``before()`` at its boundary; the times of its parts."""
        t0 = time.perf_counter()
        if before is not None:
            before()
        call = time.perf_counter() - t0
        _forward_backward(model, x)
        t1 = time.perf_counter()
        opt.step()
        opt_step = time.perf_counter() - t1
        opt.zero_grad()
        t2 = time.perf_counter()
        if after is not None:
            after()
        return {"call": call, "opt_step": opt_step, "boundary": time.perf_counter() - t2}

    out: dict[str, list] = {"plain": [], "async save": [], "snapshot": []}
    for rep in range(args.reps + 1):
        n = 10 * rep
        runs = {
            "plain": step(),
            "async save": step(lambda n=n: ckpt.save(n + 1, "bench", ("persistent",), {}, blocking=False)),
            "snapshot": step(lambda n=n: snaps.take(n + 2, {"step": n + 2}), snaps.settle),
        }
        ckpt.wait()  # the write, outside the timing (it runs while training would go on)
        if rep:
            for k, v in runs.items():
                out[k].append(v)
    blob = torch.zeros(max(snaps.bytes, 1), dtype=torch.uint8)
    loop = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(blob, 1)
            dist.recv(blob, 1)
        else:
            dist.recv(blob, 0)
            dist.send(blob, 0)
        loop.append((time.perf_counter() - t0) / 2)
    if rank == 0:
        result = {"runs": out, "bytes": snaps.bytes, "send_seconds": snaps.send_seconds, "loopback": min(loop)}
        Path(tmp, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=None, help="MiB of parameters + AdamW moments over both ranks (64)")
    p.add_argument("--reps", type=int, default=None, help="counted repetitions of each method (7)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    args.mb = args.mb or (2 if args.smoke else 64)
    args.reps = args.reps or (2 if args.smoke else 7)
    res, _ = spawn_pair(worker, args, "tg-snapshot-")
    runs = res["runs"]
    base = statistics.median(r["opt_step"] for r in runs["plain"])

    def blocked(r: dict) -> float:
        return r["call"] + max(r["opt_step"] - base, 0.0) + r["boundary"]

    ms = {k: statistics.median(blocked(r) for r in runs[k]) * 1000 for k in ("async save", "snapshot")}
    parts = {k: [statistics.median(r[p] for r in runs[k]) * 1000 for p in ("call", "opt_step", "boundary")] for k in ms}
    print(f"### a sharded model's snapshot vs the asynchronous save (FSDP2, 2 gloo ranks, {args.mb} MiB of state)")
    print(
        "| method | training blocked per save (ms, median) | the call | optimizer.step (ms; plain "
        f"{base * 1000:.2f}) | next boundary |"
    )
    print("|---|---|---|---|---|")
    for k in ms:
        call, step_ms, boundary = parts[k]
        print(f"| {k} | {ms[k]:.2f} | {call:.2f} | {step_ms:.2f} | {boundary:.2f} |")
    ratio = ms["snapshot"] / ms["async save"] if ms["async save"] > 0 else float("inf")
    print(f"snapshot / async save: {ratio:.2f}× (goal ≤ {GOAL:.2f}: {'met' if ratio <= GOAL else 'missed'})")
    rate = res["bytes"] / res["send_seconds"] if res["send_seconds"] else float("nan")
    line = res["bytes"] / res["loopback"] if res["loopback"] else float("nan")
    print("\n### the copy to the holder (background thread)")
    print("| bytes | serialize + exchange (s) | MB/s | loopback send/recv of the same bytes, MB/s | share |")
    print("|---|---|---|---|---|")
    print(f"| {res['bytes']} | {res['send_seconds']:.4f} | {rate / 1e6:.1f} | {line / 1e6:.1f} | {rate / line:.2f} |")


if __name__ == "__main__":
    main()
