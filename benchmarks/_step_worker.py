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

``--paired K`` (with ``--guard``): both loops in the same processes, in blocks of ``K`` steps
alternated plain, trainguard, trainguard, plain (ABBA): the plain loop trains a second DDP model of
the same shape, with torch's own ``clip_grad_norm_`` (trainguard wraps the name
``torch.nn.utils.clip_grad_norm_``), between two steps of the guarded loop's ``guard.steps``. The
first ABBA round is a warm-up. Rank 0 writes each block's median wall step and its mean
training-thread CPU time per step (``time.thread_time``): two blocks side by side see the same
machine, which two launches do not. Collectives and host syncs are counted in ``--count-syncs``
guarded steps after the timed blocks (counting walks the stack at every collective, which the
timed steps must not pay). Everything else of trainguard (its threads, the warm spare, the
launcher) runs through both kinds of block alike; ``per_step_cost.py``'s launch-alternated mode
measures that part.

    trainguard run --nproc-per-node 2 benchmarks/_step_worker.py --out R.json [--guard] [--pad-ms 5] [--paired 25] [--profile P]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
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


def _model(args: argparse.Namespace) -> nn.Module:
    """The MLP, seeded alike on every rank, under DDP (``--fsdp2``: ``fully_shard``-ed on a 1-D mesh)."""
    torch.manual_seed(0)
    h = args.width
    model = nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, 10))
    if not args.fsdp2:
        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def _step_plain(model, opt, x, y, clip) -> None:  # noqa: ANN001
    """One step of the plain loop (``clip``: torch's ``clip_grad_norm_``)."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    clip(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _step_guarded(guard, model, opt, x, y) -> torch.Tensor:  # noqa: ANN001
    """One step of the README's loop up to ``guard.step_end`` (the caller's): its loss."""
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if guard.should_step(loss, grad_norm):
        opt.step()
    opt.zero_grad()
    return loss


def _paired(args: argparse.Namespace, model, opt, x, y, rank: int) -> None:  # noqa: ANN001
    """``--paired``: plain and guarded blocks alternated in these processes (see the module doc)."""
    from torch.nn.utils.clip_grad import clip_grad_norm_ as torch_clip  # not the name trainguard wraps

    import trainguard

    plain = _model(args)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    pad, k = args.pad_ms / 1e3, args.paired
    order = ["plain", "guard", "guard", "plain"] * (args.rounds + 1)
    blocks: list[dict] = []
    wall, cpu = time.perf_counter, time.thread_time

    def block(kind: str, run_step) -> None:  # noqa: ANN001
        walls, cpus = [], []
        for _ in range(k):
            t0, c0 = wall(), cpu()
            run_step()
            time.sleep(pad)
            walls.append(wall() - t0)
            cpus.append(cpu() - c0)
        blocks.append({"kind": kind, "wall": statistics.median(walls), "cpu": statistics.mean(cpus)})

    with trainguard.Guard(trainguard.config_from_env(), model=model, optimizer=opt) as guard:
        steps = iter(guard.steps(order.count("guard") * k + args.count_syncs))

        def guarded() -> None:
            next(steps)
            guard.step_end(loss=_step_guarded(guard, model, opt, x, y))

        for kind in order:
            block(kind, guarded if kind == "guard" else lambda: _step_plain(plain, plain_opt, x, y, torch_clip))
        counting["on"] = True  # counted apart: the count's frame walk is not trainguard's cost
        with CountSyncs():
            for _ in range(args.count_syncs):
                guarded()
        counting["on"] = False
        for _ in steps:  # the generator's end: the final save
            pass
    if rank == 0:
        out = {"blocks": blocks[4:], "own_collectives": counting["own"] / args.count_syncs}
        out["syncs"] = counting["syncs"] / args.count_syncs
        Path(args.out).write_text(json.dumps(out))


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
    p.add_argument(
        "--paired", type=int, default=0, help="with --guard: ABBA blocks of this many steps, both loops in one job"
    )
    p.add_argument("--rounds", type=int, default=8, help="with --paired: ABBA rounds after the warm-up round")
    args, _ = p.parse_known_args()
    for name in COUNTED:  # before the Guard wraps them (in-process recovery's catching)
        fn = getattr(c10d, name)
        setattr(c10d, name, _count(fn))
        setattr(dist, name, getattr(c10d, name))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model(args)
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

    if args.paired:
        _paired(args, model, opt, x, y, rank)
        dist.destroy_process_group()
        return
    if args.guard:
        import trainguard

        with trainguard.Guard(trainguard.config_from_env(), model=model, optimizer=opt) as guard:
            t0 = time.perf_counter()
            for step in guard.steps(args.steps):
                loss = _step_guarded(guard, model, opt, x, y)
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
            _step_plain(model, opt, x, y, nn.utils.clip_grad_norm_)
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
