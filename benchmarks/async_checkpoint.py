"""Asynchronous checkpoints: how long training is blocked, against a synchronous save of the same state.

One process, a model whose fp32 parameters plus AdamW's two moments take ``--mb`` MiB (default 128,
so ≥ 100 MB). Each method saves the same state ``--reps`` times, each save followed by ``--gap``
seconds of "forward and backward" (matrix multiplications on the CPU, as a real loop would keep the
cores busy while a background write runs) and an ``optimizer.step()``. Methods, each in a fresh process, in a rotating order:

* ``trainguard sync``   — ``guard.save(blocking=True)``: DCP write with fsync, rank file,
  XXH3-128 manifest, atomic rename; blocked = the whole save;
* ``trainguard async``  — ``checkpoint.async_save``, ``guard.save(blocking=False)``: blocked = the save call (module buffers and rank
  state copied, the rest handed to the background thread) plus the time the next ``optimizer.step()``
  waits for the background copy of parameters and optimizer states; write and commit run in the
  background;
* ``torch.save``        — one file of ``{"model", "optim"}`` state dicts, fsynced;
* ``DCP sync``          — ``torch.distributed.checkpoint.save`` (``sync_files=True``);
* ``DCP async``         — ``torch.distributed.checkpoint.async_save``: blocked = until it returns.

Also: trainguard's write throughput (bytes / write time of a synchronous save) against ``dd
conv=fsync`` of the same number of bytes into the same directory, run right after each save, and load throughput
(``load_state``: ``dcp.load`` + ``set_state_dict``) against a plain read of the same files. Both
read from the page cache (nothing evicts it here); verification (checksums) is timed on its own.
trainguard's write times and the async blocked time come from its ``checkpoint_committed`` events.
``--smoke`` runs every method once, all in one process (a 4 MiB state): it only checks the path.

    .venv/bin/python benchmarks/async_checkpoint.py [--quick | --smoke] [--mb 128] [--reps 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SMOKE_HELP  # noqa: E402
from checkpoint_throughput import _build, _dd  # noqa: E402  (the same state builder and dd baseline)

GOAL_BLOCK = 0.05
GOAL_DD = 0.8
METHODS = ["trainguard sync", "trainguard async", "torch.save", "DCP sync", "DCP async"]


def _train(seconds: float) -> None:
    """Keep the CPU busy like a training step would, for ``seconds``."""
    import torch

    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _guard(work: Path, model, opt, async_save: bool):
    import trainguard

    cfg = trainguard.load_config(
        None,
        [
            f"run.dir={work}",
            "checkpoint.keep_last=1",
            f"checkpoint.async_save={str(async_save).lower()}",
            "health.preflight=false",
            "supervisor.enabled=false",
        ],
    )
    return trainguard.Guard(cfg, model=model, optimizer=opt)


def child(method: str, mb: int, reps: int, gap: float, work: Path, out: Path) -> None:
    """Save with ``method`` ``reps`` times; write ``{"blocked": [...], "total": [...], "bytes": N, ...}``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.set_num_threads(1)
    model, opt = _build(mb)
    res: dict = {"blocked": [], "total": []}
    guard = _guard(work / "run", model, opt, method == "trainguard async") if method.startswith("trainguard") else None
    for rep in range(reps + 1):  # the first save warms up (buffers, DCP plan caches) and is not counted
        done: list[float] = []
        t0 = time.perf_counter()
        if guard is not None:  # the public save; an async one returns after the snapshot
            guard.step = rep + 1
            guard.save("bench", blocking=method == "trainguard sync")
        elif method == "torch.save":
            with open(work / f"ts-{rep}.pt", "wb") as f:
                m, o = get_state_dict(model, opt)
                torch.save({"model": m, "optim": o}, f)
                f.flush()
                os.fsync(f.fileno())
        elif method == "DCP sync":
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o}, storage_writer=FileSystemWriter(work / f"dcp-{rep}", sync_files=True))
        else:  # DCP async
            m, o = get_state_dict(model, opt)
            fut = dcp.async_save(
                {"model": m, "optim": o}, storage_writer=FileSystemWriter(work / f"dcp-{rep}", sync_files=True)
            )
            fut.add_done_callback(lambda _, done=done: done.append(time.perf_counter()))
        blocked = time.perf_counter() - t0
        _train(gap)  # forward and backward go on (an async write runs meanwhile) ...
        opt.step()  # ... then the optimizer step, which waits for trainguard's background copy of the state
        if method == "DCP async":
            fut.result()
        if guard is not None:
            if method == "trainguard sync" and rep > 0:
                res["blocked"].append(blocked)  # the whole save call
                res.setdefault("dd", []).append(
                    _dd(work, _committed(guard)[rep + 1]["details"]["bytes"])
                )  # the same bytes, alternated
            continue  # the other times from the checkpoint_committed events, below
        total = done[0] - t0 if done else blocked
        if rep > 0:
            res["blocked"].append(blocked)
            res["total"].append(total)
        for q in work.glob("ts-*"):
            q.unlink()
        for q in work.glob("dcp-*"):
            shutil.rmtree(q)
    if guard is not None:
        if method == "trainguard async":  # a last (synchronous) save waits for the last async one to commit
            guard.step = reps + 2
            guard.save("bench-end")
        for step in range(2, reps + 2):
            d = _committed(guard)[step]["details"]
            if method == "trainguard async":  # the snapshot call plus the optimizer step's wait for the copy
                res["blocked"].append(d["blocked_seconds"])
            res["total"].append(d["seconds"])  # the start of the write to its commit
            res["bytes"] = d["bytes"]
    if method == "trainguard sync":
        res.update(_load_and_read(guard, model, opt, reps))
    out.write_text(json.dumps(res))


def _committed(guard) -> dict[int, dict]:
    """The ``checkpoint_committed`` events of ``guard``'s run by step."""
    from trainguard.events import read_events

    return {e["step"]: e for e in read_events(guard.run_dir, "checkpoint_committed")}


def _load_and_read(guard, model, opt, reps: int) -> dict:
    """Time ``load_state`` and full verification of the newest checkpoint, and a plain read of its files."""
    from trainguard.checkpoint import load_state
    from trainguard.checkpoint import manifest as mf

    ckpt = guard.store.committed()[-1]
    files = [p for p in ckpt.path.iterdir() if p.is_file()]
    load, read, verify = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        load_state(ckpt.path, model, opt)
        load.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
        read.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert mf.verify(ckpt.path) is None
        verify.append(time.perf_counter() - t0)
    return {"load": load, "read": read, "verify": verify, "dir_bytes": sum(p.stat().st_size for p in files)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB, 2 reps")
    p.add_argument(
        "--smoke", action="store_true", help=SMOKE_HELP + " (4 MiB, 1 rep, 0.05 s gaps, all methods in one process)"
    )
    p.add_argument("--mb", type=int, default=None, help="state size in MiB (default 128, quick 64, smoke 4)")
    p.add_argument("--reps", type=int, default=None, help="saves per method (default 5, quick 2, smoke 1)")
    p.add_argument(
        "--gap",
        type=float,
        default=None,
        help="seconds of training after each save (default: 2 × a sync save, at least 0.5; smoke 0.05)",
    )
    p.add_argument("--dir", default=None, help="directory to write in (default: a temporary directory under /tmp)")
    p.add_argument("--child", nargs=4, metavar=("METHODS", "GAP", "WORK", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    a.mb = a.mb or (4 if a.smoke else 64 if a.quick else 128)
    a.reps = a.reps or (1 if a.smoke else 2 if a.quick else 5)
    a.gap = a.gap or (0.05 if a.smoke else None)
    if a.child:  # METHODS: comma-separated, run one after the other (each in WORK/<n>, its result in OUT.<n>)
        methods, gap, work, out = a.child
        for i, method in enumerate(methods.split(",")):
            (Path(work) / str(i)).mkdir()
            child(method, a.mb, a.reps, float(gap), Path(work) / str(i), Path(f"{out}.{i}"))
        return 0

    base = Path(tempfile.mkdtemp(prefix="tg-async-", dir=a.dir))
    results: dict[str, dict] = {}
    try:

        def run_in_one_process(methods: list[str], gap: float) -> list[dict]:
            work = base / "-".join(m.replace(" ", "-").replace(".", "") for m in methods)
            work.mkdir()
            out = base / f"{work.name}.json"
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--mb",
                    str(a.mb),
                    "--reps",
                    str(a.reps),
                    "--child",
                    ",".join(methods),
                    str(gap),
                    str(work),
                    str(out),
                ],
                check=True,
            )
            shutil.rmtree(work)
            return [json.loads(Path(f"{out}.{i}").read_text()) for i in range(len(methods))]

        def run(method: str, gap: float) -> dict:
            return run_in_one_process([method], gap)[0]

        if a.gap:
            gap = a.gap
        else:  # a first synchronous run sets the gap
            gap = max(0.5, 2 * statistics.median(run("trainguard sync", 0.5)["blocked"]))
        order = METHODS[1:] + METHODS[:1]
        if a.smoke:  # one process start instead of five
            results.update(zip(order, run_in_one_process(order, gap)))
        else:
            for method in order:
                results[method] = run(method, gap)
        nbytes = results["trainguard sync"]["bytes"]
        dd = results["trainguard sync"]["dd"]
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {m: statistics.median(r["blocked"]) for m, r in results.items()}
    tot = {m: statistics.median(r["total"]) for m, r in results.items()}
    sync = med["trainguard sync"]
    print(
        f"\nstate {nbytes / 2**20:.0f} MiB on disk, {a.reps} saves per method, {gap:.2f} s of training after each; medians"
    )
    print("| method | training blocked | save done (write + commit) | blocked / trainguard sync |")
    print("|---|---|---|---|")
    for m in METHODS:
        print(f"| {m} | {med[m] * 1000:.1f} ms | {tot[m] * 1000:.0f} ms | {med[m] / sync:.3f}× |")
    ratio = med["trainguard async"] / sync
    wbps = nbytes / statistics.median(results["trainguard sync"]["total"])
    dbps = nbytes / statistics.median(dd)
    s = results["trainguard sync"]
    lbps = s["dir_bytes"] / statistics.median(s["load"])
    rbps = s["dir_bytes"] / statistics.median(s["read"])
    print("\n| ratio | value | baseline | goal |")
    print("|---|---|---|---|")
    print(
        f"| async blocked / sync save | {ratio:.3f} | {sync * 1000:.0f} ms sync save | ≤ {GOAL_BLOCK} {'met' if ratio <= GOAL_BLOCK else 'NOT met'} |"
    )
    print(
        f"| write throughput / dd conv=fsync | {wbps / dbps:.2f} ({wbps / 1e6:.0f} MB/s) | dd {dbps / 1e6:.0f} MB/s | ≥ {GOAL_DD} "
        f"{'met' if wbps / dbps >= GOAL_DD else 'NOT met'} |"
    )
    print(
        f"| load throughput / plain read | {lbps / rbps:.2f} ({lbps / 1e6:.0f} MB/s) | read {rbps / 1e6:.0f} MB/s | (information) |"
    )
    print(
        f"| full verification (XXH3-128) | {statistics.median(s['verify']) * 1000:.0f} ms "
        f"({s['dir_bytes'] / statistics.median(s['verify']) / 1e6:.0f} MB/s) | | (information) |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
