"""Cost of the end-of-run state hash (``trainguard.state_hash``) on the example GPT.

The model is ``examples/gpt.py``'s ``GPT`` at its default size (3.3 M parameters) with the
script's AdamW (two parameter groups), after one optimizer step so that ``exp_avg`` and
``exp_avg_sq`` exist: about 40 MB of float32 state per rank. Two layouts, on ``--world`` CPU
ranks (gloo, one thread each, file rendezvous):

* ``ddp``: the example's DDP wrapping (every rank holds the whole state);
* ``fsdp``: the same model under FSDP2 ``fully_shard`` on a one-dimensional CPU mesh (every
  rank holds 1/world of each parameter and optimizer state, as ``DTensor``).

Each rank times ``--repeat`` calls (``time.perf_counter`` and ``time.thread_time`` around each
call, all ranks entering together after a barrier) and rank 0 prints, for the slowest rank of each
call, the median and range of the wall time and of the calling thread's CPU time (which time spent
descheduled by other load on the machine does not inflate), and the digest. ``--impl PATH`` times the ``state_hash`` of another file instead (e.g. an earlier
``state.py`` from ``git show``), to compare formulas on the same machine.

    .venv/bin/python benchmarks/state_hash_cost.py [--world 2] [--layout ddp|fsdp|both] [--repeat 10] [--impl PATH] [--smoke]

``--smoke``: a one-layer GPT of width 32, 2 calls, both layouts: it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import SMOKE_HELP

REPO = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _rank(
    rank: int, world: int, tmp: str, layouts: list[str], repeat: int, impl: str | None, out, model_overrides: dict
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    gpt = _load(REPO / "examples" / "gpt.py", "gpt_example")
    if impl:
        state_hash = _load(Path(impl), "state_impl").state_hash
    else:
        from trainguard.state.determinism import state_hash
    for layout in layouts:  # one after the other in the same processes
        _measure(rank, world, layout, repeat, impl, out, gpt.ModelSection(**model_overrides), gpt, state_hash)
    dist.destroy_process_group()
    # torch 2.13 on CPU aborts about one exit in 15 after FSDP2 ("terminate called without an active
    # exception" from a C++ thread during interpreter shutdown, after destroy_process_group has
    # returned): the results are already out, so flush the queue and leave without the teardown.
    out.close()
    out.join_thread()
    os._exit(0)


def _measure(rank: int, world: int, layout: str, repeat: int, impl: str | None, out, cfg, gpt, state_hash) -> None:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    if layout == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        wrapped = model = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95)
    )
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 256, (8, cfg.seq_len), generator=g)
    wrapped(idx, torch.roll(idx, -1, 1)).backward()
    opt.step()
    times, cpu, digest = [], [], None
    for _ in range(repeat):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        digest = state_hash(wrapped, opt)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    t = torch.tensor([times, cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time of each call
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if rank == 0:
        ms, cpu_ms = (sorted(x * 1e3 for x in row) for row in t.tolist())
        n_params = sum(p.numel() for p in model.parameters())
        out.put(
            f"{layout} world={world} params={n_params / 1e6:.2f}M impl={impl or 'trainguard.state.determinism'}: "
            f"wall median {statistics.median(ms):.1f} ms (min {ms[0]:.1f}, max {ms[-1]:.1f}), "
            f"thread CPU median {statistics.median(cpu_ms):.1f} ms (min {cpu_ms[0]:.1f}), {repeat} calls; "
            f"same digest on all ranks: {len(set(digests)) == 1}; digest {digests[0]}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layout", choices=["ddp", "fsdp", "both"], default=None, help="default ddp, smoke both")
    p.add_argument("--repeat", type=int, default=None, help="calls timed (default 10, smoke 2)")
    p.add_argument("--impl", default=None, help="a state.py whose state_hash is timed instead of trainguard's")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = p.parse_args()
    a.layout = a.layout or ("both" if a.smoke else "ddp")
    a.repeat = a.repeat or (2 if a.smoke else 10)
    tiny = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32} if a.smoke else {}
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    layouts = ["ddp", "fsdp"] if a.layout == "both" else [a.layout]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(a.world, tmp, layouts, a.repeat, a.impl, out, tiny), nprocs=a.world, start_method="spawn"
        )
        for _ in layouts:
            print(out.get(timeout=10))


if __name__ == "__main__":
    main()
