"""The detectors' values carried in FSDP2's gradient-norm all-reduce (trainguard.instability.clipfold):
real gloo ranks, a model ``fully_shard``-ed on a 1-D mesh; torch's ``clip_grad_norm_`` and the
folded one on the same gradients. (The end-to-end count of collectives: ``tests/test_fold.py``.)"""

from __future__ import annotations

import tempfile

import pytest
import torch

STEPS = 4


def _model(world: int, replicas: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    if replicas == 1:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int, replicas: int, tmp: str, out) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from trainguard.instability.clipfold import ClipFold, foldable_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        ours, theirs = _model(world, replicas), _model(world, replicas)
        sums, sent = [], []
        fold = ClipFold(
            lambda like: torch.tensor([rank + 1.0, 10.0 * rank], dtype=like.dtype), lambda values: sums.append(values)
        )
        calls = [0]
        real = c10d.all_reduce

        def counted(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)

        c10d.all_reduce = counted
        rows = []
        for step in range(STEPS):
            torch.manual_seed(100 * step + rank)
            x = torch.randn(16, 8) * (10.0 if step == 2 else 1.0)  # step 2: clipped hard
            for model in (ours, theirs):
                model(x).pow(2).mean().backward()
            before = calls[0]
            a = fold.clip(torch.nn.utils.clip_grad_norm_, ours.parameters(), 0.5)
            own = calls[0] - before
            b = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
            same_grads = all(
                torch.equal(p.grad.to_local(), q.grad.to_local())
                for p, q in zip(ours.parameters(), theirs.parameters())
            )
            sent.append([float(v) for v in sums[-1]] if own else None)
            rows.append(
                (a.to_local().item(), b.to_local().item(), str(a.placements), str(b.placements), same_grads, own)
            )
            for model in (ours, theirs):
                model.zero_grad()
        foldable = foldable_mesh(ours.parameters()) is not None
        out.put((rank, {"rows": rows, "sums": sent, "foldable": foldable}))
    finally:
        dist.destroy_process_group()


def _run(world: int, replicas: int = 1) -> dict:
    import torch.multiprocessing as mp

    out = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as tmp:
        workers = mp.start_processes(
            _worker, args=(world, replicas, tmp, out), nprocs=world, start_method="spawn", join=False
        )
        results = dict(out.get(timeout=120) for _ in range(world))
        while not workers.join():
            pass
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_the_folded_norm_and_clipped_gradients_are_torchs_own_bit_for_bit(world):
    """1-D mesh: one all-reduce per clip (the loop's own, with the fold's values in it), the norm and
    every clipped gradient shard equal to torch's ``clip_grad_norm_`` bit for bit, a replicated
    norm as torch returns it, and the fold's values summed over every rank."""
    results = _run(world)
    for rank, res in results.items():
        assert res["foldable"]
        for step, (ours, theirs, placement, torch_placement, same_grads, own) in enumerate(res["rows"]):
            assert ours == theirs and same_grads, (rank, step, ours, theirs)
            assert placement == torch_placement == "(Replicate(),)" and own == 1
        expected = [sum(r + 1.0 for r in range(world)), sum(10.0 * r for r in range(world))]
        assert res["sums"] == [expected] * STEPS
    assert results[0]["rows"][2][0] > 0.5  # step 2 was clipped


def test_hsdp_is_not_folded_torchs_clip_runs():
    """A 2-D mesh (2 replica groups × 2 shards): the norm is reduced over a shard group only, which
    does not reach every rank; torch's own clip runs, the fold gets nothing."""
    results = _run(4, replicas=2)
    for res in results.values():
        assert not res["foldable"]
        for ours, theirs, _, _, same_grads, own in res["rows"]:
            assert ours == theirs and same_grads and own == 0
        assert res["sums"] == [None] * STEPS
