"""OOM recovery by micro-batch splitting, and the memory watchdog.

End-to-end tests run ``tests/oom_worker.py`` (a DDP regression through a wide hidden layer, 2 gloo
ranks) under ``trainguard run``. Out-of-memory errors are real: either the rank caps its address
space (RLIMIT_AS) so a full batch's activations cannot be allocated, or an injected fault asks the
allocator for an impossible size inside forward or backward of one rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, events, finish, launch
from trainguard.config import ConfigError, load_config
from trainguard.exitcodes import ExitCode
from trainguard.faults import provoke_oom
from trainguard.oom import batch_size, is_oom, slice_batch

WORKER = REPO / "tests" / "oom_worker.py"


def run_worker(run: Path, *overrides: str, inject: tuple[str, ...] = (), steps: int = 20) -> int:
    extra = tuple(x for spec in inject for x in ("--inject", spec))
    return finish(
        launch(
            run,
            f"worker.max_steps={steps}",
            "checkpoint.interval=5",
            *overrides,
            script=WORKER,
            extra=extra,
            tiny=False,
        )
    )


def steps_of(run: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run / f"steps-rank{rank}.jsonl").read_text().splitlines()]


def log(run: Path) -> str:
    return Path(f"{run}.log").read_text(errors="replace")[-3000:]


def details(run: Path, kind: str) -> list[dict]:
    return [{"step": e["step"], "rank": e["rank"], **e["details"]} for e in events(run, kind)]


# ------------------------------------------------------------------------------------------------
# units


def test_real_allocator_failures_are_recognized_by_type_or_allocator_text():
    with pytest.raises(RuntimeError) as cpu:
        provoke_oom("cpu")  # the CPU allocator's own failure: a RuntimeError, no dedicated type
    assert is_oom(cpu.value)
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory")) and is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


def test_batches_split_along_the_first_dimension():
    batch = {"x": torch.arange(10).reshape(5, 2), "pair": (torch.arange(5), "tag")}
    assert batch_size(batch) == 5
    part = slice_batch(batch, 1, 3)
    assert part["x"].tolist() == [[2, 3], [4, 5]] and part["pair"][0].tolist() == [1, 2] and part["pair"][1] == "tag"
    with pytest.raises(ValueError, match="different first dimensions"):
        batch_size((torch.zeros(4), torch.zeros(3)))
    with pytest.raises(ValueError, match="batch of tensors"):
        batch_size(["no", "tensors"])


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("memory.host_percent=150", "memory.host_percent", "less than 100"),
        ("memory.host_percent=0", "memory.host_percent", "greater than 0"),
        ("memory.rss_limit='lots'", "memory.rss_limit", "expected a size"),
        ("memory.check_interval=0", "memory.check_interval", "greater than or equal to 1"),
        ("oom.micro_batch_size=-1", "oom.micro_batch_size", "greater than or equal to 0"),
    ],
)
def test_bad_thresholds_name_the_key(override, key, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert key in str(e.value) and expected in str(e.value)
    assert load_config(None, ["memory.rss_limit='1.5GiB'"]).memory.rss_limit == int(1.5 * 2**30)


# ------------------------------------------------------------------------------------------------
# end to end


def test_real_allocation_failure_on_one_rank_splits_on_every_rank(tmp_path):
    """Rank 1 caps its address space before step 3: the full batch of 128 (32 MiB per activation)
    no longer fits; both ranks halve until it does and the run finishes (nothing deadlocks)."""
    run = tmp_path / "rlimit"
    # synchronous saves: under the address-space cap a background writer thread can abort in glibc's
    # lazy allocation of thread-local data for a library loaded after the thread started (seen once
    # in the suite: "cannot allocate memory for thread-local data: ABORT")
    code = run_worker(
        run,
        "worker.batch_size=128",
        "worker.hidden=65536",
        "worker.limit_mb=48",
        "oom.grow_after=1000",
        "checkpoint.async_save=false",
        steps=8,
    )
    assert code == 0, log(run)
    ooms, splits = details(run, "oom"), details(run, "micro_batch_split")
    assert ooms and all(o["rank"] == 1 and not o["injected"] and "DefaultCPUAllocator" in o["error"] for o in ooms)
    assert (
        splits[0]["from_size"] == 128 and splits[0]["to_size"] == 64 and splits[0]["ranks"] == {"1": ooms[0]["phase"]}
    )
    assert [s["to_size"] for s in splits] == [128 // 2 ** (i + 1) for i in range(len(splits))]
    r0, r1 = steps_of(run, 0), steps_of(run, 1)
    assert [s["micro_batch"] for s in r0] == [s["micro_batch"] for s in r1]  # every rank splits alike
    assert r0[-1]["micro_batch"] == splits[-1]["to_size"] and len(r0) == 8


def test_injected_oom_on_one_rank_retries_the_same_batch_with_equal_gradients_and_grows_back(tmp_path):
    clean = tmp_path / "ddp"  # the unsplit reference: DDP's own backward
    assert run_worker(clean, "worker.grads_at=3", "worker.plain=true", steps=3) == 0, log(clean)
    run = tmp_path / "oom"
    code = run_worker(
        run,
        "worker.grads_at=3",
        "oom.grow_after=4",
        inject=("oom:rank=1,step=3,phase=forward", "oom:rank=0,step=8,phase=backward"),
    )
    assert code == 0, log(run)
    splits = details(run, "micro_batch_split")
    assert [(s["step"], s["from_size"], s["to_size"], s["ranks"], s["accumulation"]) for s in splits] == [
        (3, 8, 4, {"1": "forward"}, [1, 2]),
        (8, 8, 4, {"0": "backward"}, [1, 2]),
    ]
    assert splits[1]["backoff"] and splits[1]["grow_after"] == 8  # the grow at step 7 failed at once
    grows = details(run, "micro_batch_grow")
    # after 4 clean steps (3..6), then after 8 (8..15: the wait doubled)
    assert [(g["step"], g["from_size"], g["to_size"]) for g in grows] == [(7, 4, 8), (16, 4, 8)]
    sizes = {s["step"]: s["micro_batch"] for s in steps_of(run, 0)}
    assert sizes[2] == 8 and sizes[3] == 4 and sizes[6] == 4 and sizes[7] == 8 and sizes[8] == 4
    assert sizes == {s["step"]: s["micro_batch"] for s in steps_of(run, 1)}
    # the retried step is the same batch: its gradients equal the unsplit step's under DDP
    for rank in (0, 1):
        split_grads = torch.load(run / f"grads-rank{rank}.pt")
        whole = torch.load(clean / f"grads-rank{rank}.pt")
        for a, b in zip(split_grads, whole):
            assert (a - b).norm() <= 1e-6 * b.norm()
    losses = [s["loss"] for s in steps_of(run, 0)]
    assert losses[:3] == pytest.approx([s["loss"] for s in steps_of(clean, 0)][:3], rel=1e-6)


def test_oom_at_micro_batch_one_gives_up(tmp_path):
    run = tmp_path / "giveup"
    code = run_worker(run, "worker.batch_size=4", inject=("oom:rank=0,step=2,phase=forward,persistent=true",))
    assert code == ExitCode.GIVE_UP, log(run)
    assert [(s["from_size"], s["to_size"]) for s in details(run, "micro_batch_split")] == [(4, 2), (2, 1)]
    (gave_up,) = details(run, "oom_give_up")
    assert gave_up["step"] == 2 and gave_up["ranks"] == {"0": "forward"}
    assert len(events(run, "launch")) == 1 and len(details(run, "oom")) == 3  # no restart
    assert "out of memory at micro-batch size 1 in step 2" in log(run)
