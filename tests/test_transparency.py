"""The transparency invariant (issue 51, DESIGN.md invariant 12), as a matrix: with no fault, every
rank's parameters and optimizer state after 5 AdamW steps are bitwise the same with and without
the Guard, under torch's launcher and under ``trainguard run`` with in-process recovery on and
off, for every row of ``tests/transparency_worker.py`` (DDP on the default group and on a
data-parallel sub-group, clipping, FSDP2 on a 1-D mesh, HSDP, FSDP2 on one dimension of a 2-D mesh
with the script's own collectives on the other, fp16 compression and PowerSGD hooks, ``no_sync``
and ``require_backward_grad_sync`` accumulation, ``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view``, bf16 autocast, ``torch.compile``), 4 gloo ranks. Each process runs
every row one after the other, each with its own Guard closed before the next (several Guards in
one process); after the last, nothing of trainguard's is left patched (tests/patch_census.py).

Before issue 51 the sub-group row trained every rank on the gradients of the whole world, and every
DDP row of 4 ranks differed in its last bits (the detectors' values appended to a bucket changed
how gloo's ring split it).

bf16 compression (``bf16_compress_hook``) needs NCCL or CUDA: not a row on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "transparency_worker.py"
RANKS = 4


def _run(cmd: list[str], out: Path, variant: str) -> tuple[dict[int, dict], str]:
    done = subprocess.run(cmd, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    written = {r: out / f"hashes-{variant}-rank{r}.json" for r in range(RANKS)}
    # gloo's teardown at a rank's exit has ended in std::terminate under load after the results
    # were written (tests/test_comm_hook.py): the results are what is compared
    teardown = "terminate called without an active exception" in said
    assert done.returncode == 0 or (teardown and all(p.exists() for p in written.values())), said[-4000:]
    return {r: json.loads(p.read_text()) for r, p in written.items()}, said


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """Every row without a Guard, under torch's launcher."""
    out = tmp_path_factory.mktemp("transparency")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), str(WORKER)]
    return out, _run([*cmd, "plain", str(out), "plain"], out, "plain")[0]


LAUNCHES = {
    "torchrun": lambda out, v: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS)],
    "trainguard-in-process": lambda out, v: [
        *(sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(RANKS)),
        *("--run-dir", str(out / f"launch-{v}"), "--set", "recovery.in_process=true"),
    ],
    "trainguard-restart": lambda out, v: [
        *(sys.executable, "-m", "trainguard.cli", "run", "--nproc-per-node", str(RANKS)),
        *("--run-dir", str(out / f"launch-{v}"), "--set", "recovery.in_process=false"),
    ],
}


@pytest.mark.parametrize("variant", list(LAUNCHES))
def test_every_row_computes_the_same_bits_with_and_without_the_guard(plain, variant):
    out, without = plain
    cmd = [*LAUNCHES[variant](out, variant), str(WORKER), "guard", str(out), variant]
    guarded, said = _run(cmd, out, variant)
    table = []
    for rank in range(RANKS):
        assert guarded[rank]["census"] == [], (rank, guarded[rank]["census"])  # every Guard closed
        for row, digest in without[rank]["hashes"].items():
            got = guarded[rank]["hashes"].get(row)
            table.append((row, rank, digest[:8], (got or "")[:8]))
    print("\n".join(f"{variant} {row} rank {r}: without {a} with {b}" for row, r, a, b in table))
    assert [t for t in table if t[2] != t[3]] == []
    # the sub-group row: two groups, two results, as without the Guard
    sub = {without[r]["hashes"]["ddp_subgroup"] for r in range(RANKS)}
    assert len(sub) == 2
    if variant == "trainguard-in-process":  # what cannot be recovered in-process is declined, said at start
        assert "in-process recovery does not apply (the model's DDP trains on a process group of 2 of 4" in said
        assert "in-process recovery does not apply (FSDP2 on a slice of a larger device mesh" in said
