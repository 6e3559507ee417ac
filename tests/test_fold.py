"""The instability detectors' values carried in DDP's first gradient bucket (trainguard.instability.fold):
2 real gloo ranks, a DDP model with trainguard's communication hook."""

from __future__ import annotations

import math
import tempfile

import torch

from trainguard.instability.detect import Detector
from trainguard.instability.fold import LossFold
from trainguard.rejoin.catch import CATCH, DDPHook
from trainguard.sections import InstabilitySection

STEPS = 8
NAN_AT = 6  # rank 1's loss is NaN at this step


def _worker(rank: int, tmp: str, shape: str, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=2)
    calls = []
    real_all_reduce = dist.all_reduce

    def counted(*args, **kwargs):  # the detector's own all-reduce goes through here; DDP's does not
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 1))
        fold = LossFold(rank)
        step = [0]
        params, _ = model._build_params_for_reducer()
        hook = DDPHook(CATCH, params, None, lambda b: fold.extra(step[0], b), lambda v: fold.reduced(step[0], v))
        model.register_comm_hook(None, hook.hook)
        fold.wire()
        folded, plain = Detector(InstabilitySection(), rank, 2), Detector(InstabilitySection(), rank, 2)
        rows = []
        for s in range(1, STEPS + 1):
            step[0] = s
            torch.manual_seed(100 * s + rank)
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if s == NAN_AT and rank == 1:
                loss = loss * float("nan")
            (loss * 2.0 if shape == "scaled" else loss).backward()
            grad = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            before = len(calls)
            a = folded.observe(s, loss, grad, fold)
            own = len(calls) - before
            b = plain.observe(s, loss, grad)
            rows.append((s, own, a.fired, a.ranks, a.loss, a.grad_norm, b.fired, b.ranks, b.loss, b.grad_norm))
            model.zero_grad()
        out.put((rank, rows))
    finally:
        fold.close()
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()


def _run(shape: str) -> list:
    import torch.multiprocessing as mp

    out = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(tmp, shape, out), nprocs=2, start_method="spawn")
        results = dict(out.get(timeout=60) for _ in range(2))
    assert str(results[0]) == str(results[1]), "every rank decides alike"  # (str: NaN equals NaN)
    return results[0]


def test_the_readme_loop_folds_the_losses_no_own_all_reduce_after_the_first_step_same_verdicts():
    """loss.backward(); should_step(loss): from step 2 the detector runs no collective of its own,
    and its verdicts (detectors fired, rank named, mean loss, gradient norm) equal the all-reduce's,
    the NaN on rank 1 included."""
    rows = _run("readme")
    own = {s: n for s, n, *_ in rows}
    assert own[1] == 1 and all(own[s] == 0 for s in range(2, STEPS + 1)), own
    for s, _, fired, ranks, loss, grad, fired_ar, ranks_ar, loss_ar, grad_ar in rows:
        assert (fired, ranks) == (fired_ar, ranks_ar), s
        assert (loss == loss_ar or math.isnan(loss) and math.isnan(loss_ar)) and (
            grad == grad_ar or math.isnan(grad) and math.isnan(grad_ar)
        ), s
    nan_row = rows[NAN_AT - 1]
    assert "nonfinite_loss" in nan_row[2] and nan_row[3] == [1]


def test_a_backward_on_another_tensor_than_should_steps_loss_keeps_the_all_reduce():
    """(AMP's scaler.scale(loss).backward(), gradient accumulation): the fold is never used."""
    rows = _run("scaled")
    assert all(own == 1 for _, own, *_ in rows)
    assert all(str(row[2:6]) == str(row[6:10]) for row in rows)


def test_fold_values_are_not_taken_for_another_step():
    fold = LossFold(0)
    fold.reduced(3, torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0]))
    assert fold.take(4, torch.tensor(1.0)) is None
