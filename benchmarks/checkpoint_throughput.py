"""Checkpoint write throughput against ``dd`` of the same bytes into the same directory (goal: ≥ 0.8).

A model plus its AdamW state of ``--mb`` MiB on disk (parameters + two moments, fp32) is saved with
``trainguard.checkpoint.save_state`` into a :class:`~trainguard.CheckpointStore`; the time covers the
whole commit: DCP write with fsync, the rank file, manifest checksums (XXH3-128), manifest fsync,
rename and directory fsync. The baseline is ``dd if=/dev/zero of=DIR/ddfile bs=4M
iflag=count_bytes count=<same bytes> conv=fsync`` in the same directory. The two alternate
(dd, save, dd, save, ...), each ``--reps`` times; medians are reported.

Also reported, for information: ``get_state_dict`` + ``dcp.save`` alone (same state,
``sync_files=True``, no rank file, no manifest, no rename) to separate DCP's cost from trainguard's, the checksum time (``describe_files`` over the
committed files, timed separately right after the save, files still in the page cache) and its
share of the save, and (``--ranks both``, the default) the same save by 2 gloo ranks.

    .venv/bin/python benchmarks/checkpoint_throughput.py [--quick | --smoke] [--mb 256] [--reps 5] [--dir DIR] [--ranks 1|2|both]
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

from _common import SMOKE_HELP

GOAL = 0.8
MiB = 1 << 20


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run (64 MiB, 2 reps, 1 rank) to check that it works")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (4 MiB, 1 rep, 1 and 2 ranks)")
    p.add_argument("--mb", type=int, default=None, help="checkpoint size in MiB (default 256, quick 64, smoke 4)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of each variant (default 5, quick 2, smoke 1)")
    p.add_argument("--dir", default=None, help="directory to write in (default: a new temporary directory under /tmp)")
    p.add_argument("--ranks", choices=["1", "2", "both"], default=None, help="ranks that save (default both, quick 1)")
    args = p.parse_args()
    args.mb = args.mb or (4 if args.smoke else 64 if args.quick else 256)
    args.reps = args.reps or (1 if args.smoke else 2 if args.quick else 5)
    args.ranks = args.ranks or ("1" if args.quick else "both")
    return args


def _build(mb: int):
    """A module whose fp32 parameters plus AdamW's two moments take about ``mb`` MiB."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    n_params = mb * MiB // 12  # 4 bytes × (param + exp_avg + exp_avg_sq)
    chunk = 2048 * 2048
    sizes = [chunk] * (n_params // chunk) + ([n_params % chunk] if n_params % chunk else [])
    model = nn.Module()
    model.chunks = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates exp_avg / exp_avg_sq
    return model, opt


def _dd(directory: Path, nbytes: int) -> float:
    target = directory / "ddfile"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", "iflag=count_bytes", f"count={nbytes}", "conv=fsync"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - t0
    target.unlink()
    return seconds


def _bench(rank: int, world: int, args: argparse.Namespace, work: str, result: str) -> None:
    """One process's part: alternate dd (rank 0) and save_state (all ranks) ``reps`` times."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainguard import dist as tgdist
    from trainguard.checkpoint import CheckpointStore, save_state
    from trainguard.checkpoint.manifest import MANIFEST, describe_files

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{work}/init", rank=rank, world_size=world)
    model, opt = _build(args.mb)
    wdir = Path(work) / f"w{world}"
    if rank == 0:
        wdir.mkdir()
    tgdist.barrier()
    store = CheckpointStore(wdir / "store", keep_last=1)
    out: dict[str, list[float]] = {"dd": [], "save": [], "checksum": [], "dcp": [], "bytes": []}
    nbytes = 0

    def run_save(rep: int) -> None:
        nonlocal nbytes
        tgdist.barrier()
        t0 = time.perf_counter()
        ckpt, nbytes = save_state(store, rep + 1, model, opt, rank_state={"step": rep + 1, "note": "bench"})
        out["save"].append(time.perf_counter() - t0)
        out["bytes"].append(nbytes)
        if rank == 0:
            names = sorted(p.name for p in ckpt.path.iterdir() if p.name != MANIFEST)
            t0 = time.perf_counter()
            describe_files(ckpt.path, names)
            out["checksum"].append(time.perf_counter() - t0)
            shutil.rmtree(ckpt.path)
        tgdist.barrier()

    def run_dd() -> None:
        if rank == 0:
            out["dd"].append(_dd(wdir, nbytes))
        tgdist.barrier()

    def run_dcp(rep: int) -> None:
        if world > 1:  # reference measured single-process only
            return
        target = wdir / f"dcp-{rep}"
        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(target, sync_files=True))
        out["dcp"].append(time.perf_counter() - t0)
        shutil.rmtree(target)

    run_save(-1)  # warm-up (DCP planning caches, page allocation); also gives the byte count for dd
    for values in out.values():
        values.clear()
    for rep in range(args.reps):  # alternate the order: save dd dcp | dcp dd save | ...
        if rep % 2 == 0:
            run_save(rep)
            run_dd()
            run_dcp(rep)
        else:
            run_dcp(rep)
            run_dd()
            run_save(rep)
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    if world > 1:
        dist.destroy_process_group()


def main() -> int:
    args = _parse()
    import warnings

    import torch.multiprocessing as mp
    from rich.console import Console
    from rich.table import Table

    warnings.filterwarnings("ignore")  # dcp.save without a process group warns once per call
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tg-bench-ckpt-", dir=base)
    results: dict[int, dict] = {}
    t_wall = time.perf_counter()
    try:
        for world in [1] if args.ranks == "1" else [2] if args.ranks == "2" else [1, 2]:
            result = os.path.join(work, f"result-{world}.json")
            if world == 1:
                _bench(0, 1, args, work, result)
            else:
                mp.spawn(_bench, args=(world, args, work, result), nprocs=world, join=True)
            results[world] = json.loads(Path(result).read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - t_wall

    med = statistics.median
    table = Table(
        title=f"Checkpoint write throughput — {args.mb} MiB model + AdamW state, {args.reps} reps, medians, dir {base}"
    )
    for col, just in (
        ("variant", "left"),
        ("bytes", "right"),
        ("seconds", "right"),
        ("MB/s", "right"),
        ("ratio vs dd", "right"),
        ("goal", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    summary = []
    for world, r in results.items():
        nbytes = int(med(r["bytes"]))
        dd_s, save_s = med(r["dd"]), med(r["save"])
        ratio = dd_s / save_s  # = save throughput / dd throughput (same bytes)
        color = "[green]" if ratio >= GOAL else "[red]"
        table.add_row(
            f"dd conv=fsync (baseline for {world} rank{'s' if world > 1 else ''})",
            f"{nbytes:,}",
            f"{dd_s:.3f}",
            f"{nbytes / dd_s / 1e6:.0f}",
            "1",
            "",
        )
        table.add_row(
            f"save_state, {world} rank{'s' if world > 1 else ''}",
            f"{nbytes:,}",
            f"{save_s:.3f}",
            f"{nbytes / save_s / 1e6:.0f}",
            f"{color}{ratio:.3f}",
            f"≥ {GOAL}",
        )
        if r["dcp"]:
            dcp_s = med(r["dcp"])
            table.add_row(
                "  get_state_dict + dcp.save alone (reference)",
                "",
                f"{dcp_s:.3f}",
                f"{nbytes / dcp_s / 1e6:.0f}",
                f"{dd_s / dcp_s:.3f}",
                "",
            )
        ck = med(r["checksum"])
        table.add_row(
            "  checksums (describe_files, all files, 1 process, hot cache)",
            "",
            f"{ck:.3f}",
            f"{nbytes / ck / 1e6:.0f}",
            "",
            f"{ck / save_s * 100:.0f}% of save",
        )
        summary.append(
            f"{world} rank(s): dd {' '.join(f'{v:.2f}' for v in r['dd'])} s | "
            f"save {' '.join(f'{v:.2f}' for v in r['save'])} s"
        )
    Console(width=140).print(table)
    for line in summary:
        print(line)
    print(f"wall {wall:.1f} s; load average {os.getloadavg()[0]:.2f} (other processes on this machine add noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
