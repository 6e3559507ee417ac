"""Training script of ``per_step_cost.py``: the README's loop, with or without trainguard.

A 4-layer MLP under DDP (gloo, one CPU thread), AdamW, a fixed batch; every step is followed by a
fixed sleep of ``--pad-ms`` (a step of ``compute + pad`` milliseconds), so that what trainguard does
in a step adds to it rather than hiding in a sleep-until. ``--guard``: the README's loop
(``guard.steps``, ``should_step(loss, grad_norm)``, ``step_end``), default configuration; else the
same loop without trainguard. Rank 0 writes ``OUT`` (JSON): the wall time of each step after
``--warmup`` steps, and the collectives trainguard called on its own from the training thread
during them (a collective whose nearest caller outside ``torch`` is trainguard's code and that is
not DDP's bucket all-reduce in trainguard's communication hook, nor, with ``--fsdp2``, the loop's
``clip_grad_norm_`` all-reduce that trainguard's wrapper runs). Then ``--count-syncs`` more steps,
untimed, under a ``TorchFunctionMode`` that counts trainguard's tensor→host conversions (``item``,
``tolist``, ``__float__``...: each a device→host sync on a GPU; the RNG states the step boundary
keeps, torch's ``uint8`` ones and NumPy's ``int64`` keys, are host tensors on every device, and
the step boundary's encoding of them is not counted).

    trainguard run --nproc-per-node 2 benchmarks/_step_worker.py --out R.json [--guard] [--pad-ms 5] [--profile P]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "broadcast_object_list")
SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")
counting = {"on": False, "own": 0, "syncs": 0, "sync_steps": 0}


def _own(frame) -> bool:  # noqa: ANN001
    """Whether the collective called from ``frame`` is trainguard's own (not DDP's bucket)."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "hook" and name == "trainguard.rejoin.catch":
            return False  # DDP's gradient bucket, through trainguard's communication hook
        if frame.f_code.co_name == "clip" and name == "trainguard.instability.clipfold":
            return False  # the loop's clip_grad_norm_ all-reduce (FSDP2), through trainguard's wrapper
        if not name.startswith("torch") and name != "trainguard.rejoin.catch" and name != __name__:
            return name.startswith("trainguard")
        frame = frame.f_back
    return False


def _count(fn):  # noqa: ANN001, ANN202
    @functools.wraps(fn)
    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if counting["on"] and threading.current_thread() is threading.main_thread() and _own(sys._getframe(1)):
            counting["own"] += 1
        return fn(*args, **kwargs)

    return counted


class CountSyncs(TorchFunctionMode):
    """Counts trainguard's tensor→host conversions (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if (
            getattr(func, "__name__", "") in SYNCS
            and args
            and torch.is_tensor(args[0])
            and args[0].dtype != torch.uint8
            and sys._getframe(1).f_globals.get("__name__") != "trainguard.rejoin.boundary"
            and _own(sys._getframe(1))
        ):
            counting["syncs"] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--guard", action="store_true")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--pad-ms", type=float, default=0.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--fsdp2", action="store_true", help="fully_shard the model on a 1-D mesh instead of DDP")
    p.add_argument("--profile", default=None, help="rank 0 writes cProfile stats of its timed steps here")
    p.add_argument("--count-syncs", type=int, default=20, help="untimed steps after the timed ones, syncs counted")
    args, _ = p.parse_known_args()
    for name in COUNTED:  # before the Guard wraps them (in-process recovery's catching)
        fn = getattr(c10d, name)
        setattr(c10d, name, _count(fn))
        setattr(dist, name, getattr(c10d, name))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    h = args.width
    model = nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 10))
    if args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    pad = args.pad_ms / 1e3
    times: list[float] = []

    import cProfile

    prof = cProfile.Profile() if args.profile and dist.get_rank() == 0 else None

    last_timed = args.steps - args.count_syncs
    mode = CountSyncs()

    def timed(step: int, t0: float) -> None:
        if step == args.warmup:
            counting["on"] = True
            if prof is not None:
                prof.enable()
        if args.warmup < step <= last_timed:
            times.append(time.perf_counter() - t0)
        elif step > last_timed:
            counting["sync_steps"] += 1
        if step == last_timed:
            counting["on"] = False
            if prof is not None:
                prof.disable()
            mode.__enter__()  # the steps after it: syncs counted, not timed

    if args.guard:
        import trainguard

        with trainguard.Guard(trainguard.config_from_env(), model=model, optimizer=opt) as guard:
            t0 = time.perf_counter()
            for step in guard.steps(args.steps):
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if guard.should_step(loss, grad_norm):
                    opt.step()
                opt.zero_grad()
                time.sleep(pad)
                guard.step_end(loss=loss)
                timed(step, t0)
                if step == args.steps - 1:  # the last step: the final save that follows is not a step's
                    mode.__exit__(None, None, None)
                t0 = time.perf_counter()
            counting["on"] = False
    else:
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            time.sleep(pad)
            timed(step, t0)
            t0 = time.perf_counter()
        mode.__exit__(None, None, None)
    if prof is not None:
        prof.dump_stats(args.profile)
    if rank == 0:
        syncs = counting["syncs"] / max(counting["sync_steps"], 1)
        Path(args.out).write_text(json.dumps({"times": times, "own_collectives": counting["own"], "syncs": syncs}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
