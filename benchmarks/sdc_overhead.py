"""Cost of the silent-data-corruption check (``[sdc]``, :mod:`trainguard.sdc.replicas`) against a training step.

The model is ``examples/gpt.py``'s ``GPT`` at its default size (3.3 M parameters) with its AdamW,
DDP on ``--world`` CPU ranks (gloo, one thread each, file rendezvous), batch ``--batch``. In the
same processes, alternately, each rank times ``--repeat`` training steps (forward, backward with
DDP's all-reduce, optimizer step) and ``--repeat`` replica checks (the parameter fingerprint and
the all-reduce that compares it: exactly what the Guard runs at a check step). Rank 0 prints the
slowest rank's medians and the step-time ratio with one check every N steps:
``(N × step + check) / (N × step)``, for N = 10, 100 (the default ``check_interval``) and 1000.

The step re-run (``[sdc] on_instability = "rerun"``, :mod:`trainguard.sdc.rerun`) in the same
processes: what it costs every step (keeping the step-boundary state: data position and RNG
streams, encoded in memory; and the RNG state the forward pre-hook keeps with the references to
the step's inputs), what one re-run costs (restoring that state, the step again, the two results'
fingerprints and their all-gather) and one cross-check (the suspect's inputs sent, its forward
replayed on it and its partner, :mod:`trainguard.sdc.crosscheck`), each against the training step.

    .venv/bin/python benchmarks/sdc_overhead.py [--world 2] [--batch 8] [--repeat 20] [--smoke]

``--smoke``: a one-layer GPT of width 32, 3 repeats: it only checks that the script runs.
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
GOAL = 1.005  # step-time ratio at the default interval


def _rank(rank: int, world: int, tmp: str, batch: int, repeat: int, out, model_overrides: dict) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.ranks import Ranks
    from trainguard.rejoin.boundary import BoundaryState
    from trainguard.sampler import ResumableSampler
    from trainguard.sdc.crosscheck import StepInputs, cross_check
    from trainguard.sdc.replicas import ReplicaCheck
    from trainguard.sdc.rerun import StepRerun, step_result
    from trainguard.sections import SDCSection
    from trainguard.state.trainstate import RNGState, TrainState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    spec = importlib.util.spec_from_file_location("gpt_example", REPO / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["gpt_example"] = gpt
    spec.loader.exec_module(gpt)
    cfg = gpt.ModelSection(**model_overrides)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    check = ReplicaCheck(SDCSection(check_interval=1), ddp, Ranks(rank, world), events=None)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        idx = torch.randint(0, 256, (batch, cfg.seq_len), generator=g)
        opt.zero_grad(set_to_none=True)
        ddp(idx, torch.roll(idx, -1, 1)).backward()
        opt.step()

    # what the Guard keeps at each step boundary for a re-run (as in-process recovery does)
    local = TrainState({"sampler": ResumableSampler(100_000, rank, world), "rng": RNGState()})
    boundary, rerun = BoundaryState(None, rank), StepRerun(True, Ranks(rank, world))

    inputs = StepInputs(ddp)

    def keep(i: int) -> None:
        boundary.keep({"step": i, **local.state_dict()})
        torch.get_rng_state()  # what StepInputs' forward pre-hook keeps besides references

    def rerun_step(i: int) -> None:  # the first run's result, the state put back, the step again, the verdict
        rerun.start(i, step_result(torch.tensor(1.0), ddp))
        local.load_state_dict(boundary.restore(i))
        step()
        rerun.classify(step_result(torch.tensor(1.0), ddp), 1.0)

    step()  # warm-up: buckets built, optimizer state allocated
    keep(0)
    steps, checks, keeps, reruns, crosses = [], [], [], [], []
    for i in range(repeat):  # alternated, so that load on the machine hits all alike
        inputs.step_begin(1)  # the timed step's forward is recorded, as in a guarded loop
        for fn, times in ((step, steps), (lambda: check.check(1), checks), (lambda i=i: keep(i), keeps)):
            dist.barrier()
            t0 = time.perf_counter()
            assert fn() is None, "the replicas differ"
            times.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        fps = cross_check(inputs, 0, rank, world)
        crosses.append(time.perf_counter() - t0)
        assert fps is not None and fps[0] == fps[1], "a healthy cross-check differs"
        dist.barrier()
        t0 = time.perf_counter()
        rerun_step(i)
        reruns.append(time.perf_counter() - t0)
    t = torch.tensor([steps, checks, keeps, reruns, crosses], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank of each
    if rank == 0:
        step_s, check_s, keep_s, rerun_s, cross_s = (statistics.median(row) for row in t.tolist())
        n = sum(p.numel() for p in model.parameters())
        lines = [
            f"SDC replica check vs a training step: GPT {n / 1e6:.2f} M parameters, DDP on {world} CPU ranks, "
            f"batch {batch}, {repeat} alternated repeats (slowest rank, median)",
            "| what | ms |",
            "|---|---|",
            f"| training step (baseline) | {step_s * 1e3:.2f} |",
            f"| one check: fingerprint + all-reduce | {check_s * 1e3:.3f} |",
            "",
            "| check every N steps | step-time ratio |",
            "|---|---|",
        ]
        for every in (10, 100, 1000):
            lines.append(f"| {every} | {(every * step_s + check_s) / (every * step_s):.5f}× |")
        ratio = (100 * step_s + check_s) / (100 * step_s)
        lines.append(f"default interval (100): {ratio:.5f}× — goal ≤ {GOAL}×: {'met' if ratio <= GOAL else 'MISSED'}")
        lines += [
            "",
            "| step re-run (on_instability = rerun) | ms | vs the step |",
            "|---|---|---|",
            f"| keep the boundary state, every step | {keep_s * 1e3:.3f} | {(step_s + keep_s) / step_s:.5f}× |",
            f"| one re-run of an unstable step | {rerun_s * 1e3:.2f} | {rerun_s / step_s:.3f}× |",
            f"| one cross-check of a suspect rank (inputs sent, forward on 2 ranks) | {cross_s * 1e3:.2f} | {cross_s / step_s:.3f}× |",
        ]
        out.put("\n".join(lines))
    dist.destroy_process_group()
    out.close()
    out.join_thread()
    os._exit(0)  # as state_hash_cost.py: skip a teardown that can abort after the results are out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=None, help="steps and checks timed (default 20, smoke 3)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = p.parse_args()
    a.repeat = a.repeat or (3 if a.smoke else 20)
    tiny = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32} if a.smoke else {}
    import torch.multiprocessing as mp

    out = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(a.world, tmp, a.batch, a.repeat, out, tiny), nprocs=a.world, start_method="spawn"
        )
        print(out.get(timeout=10))


if __name__ == "__main__":
    main()
